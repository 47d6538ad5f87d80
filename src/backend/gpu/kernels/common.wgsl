// Shared by every kernel (prepended by the Rust side after the `enable`/`alias W` header).

// GELU, tanh approximation (GPT-2's "gelu_new"):
//     gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
// The tanh argument is clamped to [-10, 10] first: tanh is +-1 to f32 precision beyond
// |u| > 9.01, and a large pre-activation (1e2..1e3 gives u ~ 1e5..1e8) otherwise
// overflows exp() inside some GPUs' fast tanh, which then returns NaN.
// The inner sum is an explicit fma rather than a product and a sum that a compiler may or
// may not fuse, so the matmul's epilogue and its split pass's (two pipelines) are more
// likely to compile alike; the parity suite checks their bits on each adapter it runs on.
fn gelu_tanh(v: f32) -> f32 {
    let u = clamp(0.7978845608028654 * fma(0.044715 * v * v, v, v), -10.0, 10.0);
    return 0.5 * v * (1.0 + tanh(u));
}
