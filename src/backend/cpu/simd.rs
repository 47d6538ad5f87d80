//! SIMD primitives behind safe wrappers, chosen at run time.
//!
//! [`Isa::detect`] picks, on x86-64, AVX-512 F/BW/VL with VNNI and BF16, else with VNNI,
//! else AVX-512 F/BW/VL, else AVX2+FMA+F16C, else the portable path: plain Rust written in fixed-width chunks
//! that LLVM vectorizes for the target (SSE2 on any x86-64, NEON on aarch64). Each level
//! includes the ones below: a kernel without a version for it runs the next one down.
//! `BATCH_FORGE_ISA=avx512-bf16|avx512-vnni|avx512|avx2|portable` caps the choice (to compare paths
//! on one machine). Every public function here is safe; the `unsafe` SIMD bodies
//! are only reached after detection proved the features exist.

/// Names of the levels, best first, as `BATCH_FORGE_ISA` takes them.
const LEVEL_NAMES: [&str; 5] = ["avx512-bf16", "avx512-vnni", "avx512", "avx2", "portable"];

/// The instruction set the kernels run with: a token that only run-time detection can
/// make for anything beyond the portable path, so safe code cannot ask for instructions
/// this CPU lacks (its field is private; [`Isa::avx2`] checks the CPU first).
///
/// ```compile_fail
/// // Safe code cannot name the AVX2 path without detection.
/// let isa = batch_forge::backend::cpu::Isa::Avx2;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Isa(IsaKind);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IsaKind {
    /// [`IsaKind::Avx512Vnni`] plus AVX512-BF16 (`vdpbf16ps`): Cooper Lake, Sapphire Rapids,
    /// Zen 4 and later.
    Avx512Bf16,
    /// x86-64 with AVX-512 F/BW/VL and VNNI besides AVX2, FMA and F16C (Ice Lake, Zen 4).
    Avx512Vnni,
    /// x86-64 with AVX-512 F/BW/VL besides AVX2, FMA and F16C, no VNNI (Skylake-SP).
    Avx512,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// Any CPU: auto-vectorized Rust.
    Portable,
}

impl Isa {
    /// Any CPU: auto-vectorized Rust.
    pub const PORTABLE: Isa = Isa(IsaKind::Portable);

    /// AVX2 + FMA + F16C, if this CPU has them.
    pub fn avx2() -> Option<Isa> {
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
                && std::is_x86_feature_detected!("f16c")
            {
                return Some(Isa(IsaKind::Avx2));
            }
        }
        None
    }

    /// AVX-512 F/BW/VL (with AVX2, FMA and F16C), if this CPU has them; the integer dots
    /// stay on AVX2 at this level.
    pub fn avx512() -> Option<Isa> {
        #[cfg(target_arch = "x86_64")]
        {
            if Isa::avx2().is_some()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
            {
                return Some(Isa(IsaKind::Avx512));
            }
        }
        None
    }

    /// [`Isa::avx512`] plus AVX512-VNNI for the quantized kernels' integer dot products:
    /// Intel from Ice Lake, AMD from Zen 4.
    pub fn avx512_vnni() -> Option<Isa> {
        #[cfg(target_arch = "x86_64")]
        {
            if Isa::avx512().is_some() && std::is_x86_feature_detected!("avx512vnni") {
                return Some(Isa(IsaKind::Avx512Vnni));
            }
        }
        None
    }

    /// [`Isa::avx512_vnni`] plus AVX512-BF16, whose `vdpbf16ps` multiplies bf16 weights
    /// by bf16-rounded activations (two products per f32 lane and instruction).
    pub fn avx512_bf16() -> Option<Isa> {
        #[cfg(target_arch = "x86_64")]
        {
            if Isa::avx512_vnni().is_some() && std::is_x86_feature_detected!("avx512bf16") {
                return Some(Isa(IsaKind::Avx512Bf16));
            }
        }
        None
    }

    /// The best this CPU runs, capped by `BATCH_FORGE_ISA` (`avx512-bf16`, `avx512-vnni`,
    /// `avx512`, `avx2` or `portable`) when set; decided once per process.
    pub fn detect() -> Isa {
        static CHOSEN: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            let levels = [Isa::avx512_bf16(), Isa::avx512_vnni(), Isa::avx512(), Isa::avx2(), Some(Isa::PORTABLE)];
            let best = levels.into_iter().flatten().next().unwrap_or(Isa::PORTABLE);
            let Ok(cap) = std::env::var("BATCH_FORGE_ISA") else { return best };
            let Some(at) = LEVEL_NAMES.iter().position(|n| *n == cap) else {
                eprintln!(
                    "warning: BATCH_FORGE_ISA={cap:?} is not one of {}; using {}",
                    LEVEL_NAMES.join(", "),
                    best.name()
                );
                return best;
            };
            // The best level at or below the cap that this CPU has.
            levels[at..].iter().flatten().next().copied().unwrap_or(Isa::PORTABLE)
        })
    }

    /// Whether AVX2 kernels may run (the AVX2 or an AVX-512 path; by construction the CPU
    /// has the features).
    pub fn is_avx2(self) -> bool {
        self.0 != IsaKind::Portable
    }

    /// Whether AVX-512 F/BW/VL kernels may run.
    pub fn is_avx512(self) -> bool {
        matches!(self.0, IsaKind::Avx512 | IsaKind::Avx512Vnni | IsaKind::Avx512Bf16)
    }

    /// Whether AVX512-VNNI kernels may run.
    pub fn has_vnni(self) -> bool {
        matches!(self.0, IsaKind::Avx512Vnni | IsaKind::Avx512Bf16)
    }

    /// Whether AVX512-BF16 kernels may run: bf16 weight matrices then multiply
    /// bf16-rounded activations with `vdpbf16ps`, as llama.cpp does for BF16 tensors.
    pub fn has_bf16(self) -> bool {
        self.0 == IsaKind::Avx512Bf16
    }

    pub fn name(self) -> &'static str {
        match self.0 {
            IsaKind::Avx512Bf16 => "avx512-bf16",
            IsaKind::Avx512Vnni => "avx512-vnni",
            IsaKind::Avx512 => "avx512",
            IsaKind::Avx2 => "avx2",
            IsaKind::Portable => "portable",
        }
    }

    /// What the kernels of this path use, for `forge devices` and `forge bench`.
    pub fn features(self) -> &'static str {
        match self.0 {
            IsaKind::Avx512Bf16 => {
                "AVX-512 F/BW/VL prefill GEMM, AVX512-VNNI quantized dots, AVX512-BF16 bf16-weight products; \
                 AVX2/FMA/F16C f32/f16 decode GEMV and elsewhere"
            }
            IsaKind::Avx512Vnni => {
                "AVX-512 F/BW/VL prefill GEMM, AVX512-VNNI quantized dots; AVX2/FMA/F16C decode GEMV and elsewhere"
            }
            IsaKind::Avx512 => "AVX-512 F/BW/VL prefill GEMM; AVX2/FMA/F16C decode GEMV, quantized dots and elsewhere",
            IsaKind::Avx2 => "AVX2/FMA/F16C",
            IsaKind::Portable => "auto-vectorized Rust",
        }
    }

    /// One line for people: the CPU's model name, this path, its vector width, and (when
    /// `peak` is given, from [`fma_probe`]) the FMA peak of one thread.
    pub fn describe(self, peak_gflops: Option<f64>) -> String {
        let model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|c| {
                let line = c.lines().find(|l| l.starts_with("model name"))?;
                line.split(':').nth(1).map(|m| m.trim().to_owned())
            })
            .unwrap_or_else(|| std::env::consts::ARCH.to_owned());
        let peak = peak_gflops.map(|g| format!(", FMA peak ≈ {g:.0} GFLOP/s per thread")).unwrap_or_default();
        format!(
            "cpu: {model}; kernels: {} ({}-bit vectors: {}){peak}",
            self.name(),
            self.vector_bits(),
            self.features()
        )
    }

    /// Vector width of the widest kernels, in bits.
    pub fn vector_bits(self) -> usize {
        match self.0 {
            IsaKind::Avx512Bf16 | IsaKind::Avx512Vnni | IsaKind::Avx512 => 512,
            IsaKind::Avx2 => 256,
            IsaKind::Portable => 128,
        }
    }

    /// One FMA probe of about `seconds`: GFLOP/s of one thread (see [`fma_probe`]).
    pub fn fma_peak(self, seconds: f64) -> f64 {
        let start = std::time::Instant::now();
        let mut flops = 0.0;
        while start.elapsed().as_secs_f64() < seconds {
            flops += fma_probe(self, 1 << 16);
        }
        flops / start.elapsed().as_secs_f64() / 1e9
    }
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// tanh(u) is ±1 in f32 beyond |u| > 9.01; clamping keeps exp(2u) finite.
const TANH_CLAMP: f32 = 10.0;

/// Run portable code compiled for FMA where this x86-64 CPU has it: its `mul_add`s become
/// single instructions instead of calls to the C library's `fmaf` (the portable build
/// targets x86-64 without FMA), some thirty times faster in the dense products. The operations
/// are the same IEEE ones (rustc never lets LLVM contract `a * b + c` on its own), so the
/// bits are too; elsewhere this is a plain call. The kernels passed here are
/// `#[inline(always)]` and each closure has one call site, so they are compiled inside the
/// FMA function (were one not inlined, it would only be slower).
#[inline(always)]
pub(crate) fn portable<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    return x86::portable_with_fma(f);
    #[cfg(not(target_arch = "x86_64"))]
    f()
}

/// `x > lo ? x : lo`: what `maxps(x, lo)` gives lane by lane (a NaN `x` becomes `lo`).
#[inline(always)]
fn max_lane(x: f32, lo: f32) -> f32 {
    if x > lo { x } else { lo }
}

/// `x < hi ? x : hi`: what `minps(x, hi)` gives lane by lane (a NaN `x` becomes `hi`).
#[inline(always)]
fn min_lane(x: f32, hi: f32) -> f32 {
    if x < hi { x } else { hi }
}

/// exp(x) for x clamped to [-87, 88]: 2^n · p(r), r = x - n ln2 (ln2 split in two),
/// degree-6 polynomial (Cephes expf coefficients), max relative error ≈ 2 ulp. A NaN `x`
/// gives exp(-87), as the kernels' `maxps(x, -87)` does ([`softmax`] checks its inputs).
///
/// This is the one definition of exp in the kernels: every SIMD lane (`x86::exp256`,
/// `x86::exp512`) computes exactly these operations, each one IEEE-rounded (`mul_add` is
/// one fused multiply-add, an FMA instruction where the target has one), so every ISA
/// path gives the same bits. libm's `expf` is not used: its last bit differs between
/// libraries.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = min_lane(max_lane(x, -87.0), 88.0);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(EXP_LN2_HI, x);
    let r = (-n).mul_add(EXP_LN2_LO, r);
    let mut p = EXP_P[0];
    for c in &EXP_P[1..] {
        p = p.mul_add(r, *c);
    }
    p = p.mul_add(r * r, r + 1.0);
    // n is a whole number in [-126, 127]: 2^n is a normal float built from its exponent bits.
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// ln 2 in two parts for [`exp`]'s range reduction.
const EXP_LN2_HI: f32 = 0.693_359_4;
const EXP_LN2_LO: f32 = -2.121_944_4e-4;
/// [`exp`]'s polynomial, highest power first.
const EXP_P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];

/// GELU (tanh form) of one value: the definition every path computes, lane by lane,
/// `0.5x · (1 + tanh(u))` with `u = √(2/π) · fma(0.044715, x³, x)` clamped to ±10 and
/// `tanh(u) = 1 − 2 / (exp(2u) + 1)` through [`exp`].
#[inline(always)]
pub fn gelu_scalar(x: f32) -> f32 {
    let x3 = (x * x) * x;
    let u = SQRT_2_OVER_PI * 0.044715f32.mul_add(x3, x);
    let u = min_lane(max_lane(u, -TANH_CLAMP), TANH_CLAMP);
    let e = exp(u + u);
    let tanh = 1.0 - 2.0 / (e + 1.0);
    (0.5 * x) * (1.0 + tanh)
}

/// In-place GELU over a slice.
pub fn gelu(isa: Isa, v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx512() {
        // SAFETY: an AVX-512 `Isa` exists only where detection found avx512f/bw/vl and
        // avx2+fma+f16c.
        return unsafe { x86::gelu_avx512(v) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: an AVX2 `Isa` exists only where detection found avx2+fma+f16c.
        return unsafe { x86::gelu(v) };
    }
    let _ = isa;
    portable(|| v.iter_mut().for_each(|x| *x = gelu_scalar(*x)));
}

/// Dot product.
pub fn dot(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: features checked by detection; lengths checked above.
        return unsafe { x86::dot(a, b) };
    }
    let _ = isa;
    portable(|| dot_widened(a, b))
}

/// What attention's row kernels read: cached keys and values in f32 or f16 (widened
/// exactly to f32 as they are read, so an f16 row gives the bits its f32 copy would).
#[cfg(target_arch = "x86_64")]
pub trait KvElem: x86::Elem + Send + Sync {
    fn widen(self) -> f32;
}
/// What attention's row kernels read (see the x86 definition).
#[cfg(not(target_arch = "x86_64"))]
pub trait KvElem: Copy + Send + Sync {
    fn widen(self) -> f32;
}

impl KvElem for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl KvElem for half::f16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }
}

/// The sum of eight lanes in the order `x86::hsum` reduces a 256-bit register:
/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
#[inline(always)]
fn hsum8(l: [f32; 8]) -> f32 {
    let s: [f32; 4] = std::array::from_fn(|i| l[i] + l[i + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
}

/// The portable [`dot`] of f32 `a` and `b` widened element by element (no copy), in the
/// one order every path uses: 32-wide steps into four 8-lane FMA chains (element
/// `i` of a step into chain `i / 8`, lane `i % 8`), then 8-wide steps into chain 0, the
/// chains added as `(c0 + c1) + (c2 + c3)` lane by lane, the lanes by [`hsum8`], then the
/// last `n % 8` products one by one (a multiply, then an add).
#[inline(always)]
fn dot_widened<T: KvElem>(a: &[f32], b: &[T]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [[0.0f32; 8]; 4];
    let mut i = 0;
    while i + 32 <= n {
        for (j, chain) in acc.iter_mut().enumerate() {
            for (l, c) in chain.iter_mut().enumerate() {
                *c = a[i + 8 * j + l].mul_add(b[i + 8 * j + l].widen(), *c);
            }
        }
        i += 32;
    }
    while i + 8 <= n {
        for (l, c) in acc[0].iter_mut().enumerate() {
            *c = a[i + l].mul_add(b[i + l].widen(), *c);
        }
        i += 8;
    }
    let mut s = hsum8(std::array::from_fn(|l| (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l])));
    for k in i..n {
        s += a[k] * b[k].widen();
    }
    s
}

/// `scores[j] = dot(q, rows[j·n .. (j+1)·n]) · scale` for every row (`n = q.len()`),
/// each exactly as [`dot`] computes it on the row widened to f32: attention scores
/// against one head's cached keys.
pub fn dot_rows<T: KvElem>(isa: Isa, q: &[f32], rows: &[T], scale: f32, scores: &mut [f32]) {
    let n = q.len();
    assert_eq!(rows.len(), scores.len() * n, "dot_rows: shapes");
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: features checked by detection (AVX2 implies F16C here); shapes checked.
        return unsafe { x86::dot_rows(q, rows, scale, scores) };
    }
    portable(|| {
        for (sc, row) in scores.iter_mut().zip(rows.chunks_exact(n.max(1))) {
            *sc = dot_widened(q, row) * scale;
        }
    })
}

/// `out = Σ_j p[j] · rows[j·n .. (j+1)·n]` (`n = out.len()`), summed in `j` order from
/// zero with a separate multiply and add per term, exactly as [`axpy`] called for each
/// row in turn: attention's weighted values.
pub fn weighted_rows<T: KvElem>(isa: Isa, p: &[f32], rows: &[T], out: &mut [f32]) {
    weighted_rows_from(isa, p, rows, out, false)
}

/// `out += Σ_j p[j] · rows[j·n .. (j+1)·n]`, continuing [`weighted_rows`]'s sums from
/// `out` in `j` order: two calls over the two runs of a wrapped ring give the bits of
/// one call over the positions in order.
pub fn weighted_rows_add<T: KvElem>(isa: Isa, p: &[f32], rows: &[T], out: &mut [f32]) {
    weighted_rows_from(isa, p, rows, out, true)
}

fn weighted_rows_from<T: KvElem>(isa: Isa, p: &[f32], rows: &[T], out: &mut [f32], add: bool) {
    let n = out.len();
    assert_eq!(rows.len(), p.len() * n, "weighted_rows: shapes");
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: features checked by detection (AVX2 implies F16C here); shapes checked.
        return unsafe { x86::weighted_rows(p, rows, out, add) };
    }
    let _ = isa;
    if !add {
        out.fill(0.0);
    }
    for (&pj, row) in p.iter().zip(rows.chunks_exact(n.max(1))) {
        // `axpy`'s loop on the row widened element by element (no copy).
        for (yv, xv) in out.iter_mut().zip(row) {
            *yv += pj * xv.widen();
        }
    }
}

/// `y += a * x`.
pub fn axpy(isa: Isa, a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    let _ = isa; // LLVM vectorizes this loop well on every target.
    for (yv, xv) in y.iter_mut().zip(x) {
        *yv += a * xv;
    }
}

/// Softmax in place (the slice then sums to 1): every path computes the same bits
/// ([`exp`], the sum in `exp_sub_sum`'s order, one reciprocal, a multiply each). A NaN or
/// +inf input makes every output NaN (never hidden: the engine reports non-finite logits).
pub fn softmax(isa: Isa, v: &mut [f32]) {
    let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::INFINITY || v.iter().any(|x| x.is_nan()) {
        v.fill(f32::NAN);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    let sum = if isa.is_avx2() {
        // SAFETY: features checked by detection.
        unsafe { x86::exp_sub_sum(v, max) }
    } else {
        portable(|| exp_sub_sum(v, max))
    };
    #[cfg(not(target_arch = "x86_64"))]
    let sum = {
        let _ = isa;
        portable(|| exp_sub_sum(v, max))
    };
    let inv = 1.0 / sum;
    v.iter_mut().for_each(|x| *x *= inv);
}

/// `v[i] = exp(v[i] − max)`, returning their sum in the order of `x86::exp_sub_sum`:
/// eight lanes (element `i` of each whole 8-wide step into lane `i % 8`), [`hsum8`], then
/// the last `len % 8` one by one.
#[inline(always)]
fn exp_sub_sum(v: &mut [f32], max: f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = v.chunks_exact_mut(8);
    for c in &mut chunks {
        for (x, a) in c.iter_mut().zip(acc.iter_mut()) {
            *x = exp(*x - max);
            *a += *x;
        }
    }
    let mut s = hsum8(acc);
    for x in chunks.into_remainder() {
        *x = exp(*x - max);
        s += *x;
    }
    s
}

/// LayerNorm of `x` into `out`: `(x - mean) / sqrt(var + eps) * gain + shift`.
pub fn layer_norm(x: &[f32], gain: &[f32], shift: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len() as f32;
    let mean = sum(x) / n;
    let mut sq = [0.0f32; 16];
    let chunks = x.chunks_exact(16);
    let mut var = chunks.remainder().iter().map(|v| (v - mean) * (v - mean)).sum::<f32>();
    for c in chunks {
        for i in 0..16 {
            let d = c[i] - mean;
            sq[i] += d * d;
        }
    }
    var += sq.iter().sum::<f32>();
    let inv_std = 1.0 / (var / n + eps).sqrt();
    for (((o, &v), &g), &b) in out.iter_mut().zip(x).zip(gain).zip(shift) {
        *o = (v - mean) * inv_std * g + b;
    }
}

/// RMSNorm of `x` into `out`: `x / sqrt(mean(x²) + eps) * gain`.
pub fn rms_norm(x: &[f32], gain: &[f32], eps: f32, out: &mut [f32]) {
    let mut sq = [0.0f32; 16];
    let chunks = x.chunks_exact(16);
    let mut total = chunks.remainder().iter().map(|v| v * v).sum::<f32>();
    for c in chunks {
        for i in 0..16 {
            sq[i] += c[i] * c[i];
        }
    }
    total += sq.iter().sum::<f32>();
    let inv_rms = 1.0 / (total / x.len() as f32 + eps).sqrt();
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(gain) {
        *o = v * inv_rms * g;
    }
}

/// SiLU, `x / (1 + exp(0 − x))` through [`exp`]: the definition every path computes.
#[inline(always)]
pub fn silu_scalar(x: f32) -> f32 {
    x / (1.0 + exp(0.0 - x))
}

/// `out = silu(gate) · up`.
pub fn swiglu(isa: Isa, gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && up.len() == out.len());
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: features checked by detection; lengths checked above.
        return unsafe { x86::swiglu(gate, up, out) };
    }
    let _ = isa;
    portable(|| {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = silu_scalar(g) * u;
        }
    })
}

/// Sum of a slice (the memory-bandwidth probe's kernel).
pub fn sum_isa(isa: Isa, x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: features checked by detection.
        return unsafe { x86::sum(x) };
    }
    let _ = isa;
    sum(x)
}

/// The FMA-throughput probe behind `forge bench --flops`: `iters` rounds of 12
/// independent multiply-add chains on the ISA's widest vectors (AVX-512: 12 × 16 lanes,
/// AVX2: 12 × 8, portable: 12 × 4, which LLVM keeps in SIMD registers as a multiply and
/// an add). Returns the floating-point operations done, 2 per lane per round.
pub fn fma_probe(isa: Isa, iters: usize) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx512() {
        // SAFETY: an AVX-512 `Isa` exists only where detection found the features.
        std::hint::black_box(unsafe { x86::fma_probe512(iters) });
        return (iters * 12 * 16 * 2) as f64;
    }
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: features checked by detection.
        std::hint::black_box(unsafe { x86::fma_probe256(iters) });
        return (iters * 12 * 8 * 2) as f64;
    }
    let _ = isa;
    let mut acc = [[1.0f32; 4]; 12];
    let (m, c) = std::hint::black_box((0.999_999f32, 1e-7f32));
    for _ in 0..iters {
        for a in acc.iter_mut() {
            for v in a.iter_mut() {
                *v = *v * m + c;
            }
        }
    }
    std::hint::black_box(acc);
    (iters * 12 * 4 * 2) as f64
}

/// Sum with 16 partial sums (vectorizes on every target).
pub fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for i in 0..16 {
            acc[i] += c[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

/// For tests: the AVX2 path, or `None` with a loud skip. Under `CI=true` a skip on a CPU
/// whose /proc/cpuinfo lists avx2, fma and f16c panics: detection must not silently drop
/// a path the machine has.
#[doc(hidden)]
pub fn avx2_or_skip() -> Option<Isa> {
    level_or_skip(Isa::avx2, "AVX2/FMA/F16C", &["avx2", "fma", "f16c"])
}

/// For tests: `level()` (a SIMD path), or `None` after a loud skip where the CPU lacks
/// it. Under `CI=true` a machine whose /proc/cpuinfo lists every flag in `flags` and yet
/// detects no such path panics.
fn level_or_skip(level: fn() -> Option<Isa>, name: &str, flags: &[&str]) -> Option<Isa> {
    let isa = level();
    if isa.is_none() && !cfg!(miri) {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let line = cpuinfo.lines().find(|l| l.starts_with("flags")).unwrap_or_default();
        let claims = flags.iter().all(|f| line.split_whitespace().any(|w| w == *f));
        let ci = std::env::var("CI").is_ok_and(|v| v == "true");
        assert!(!(ci && claims), "CI=true: /proc/cpuinfo lists {flags:?}, yet no {name} path was detected");
        eprintln!("*** SKIPPED: no {name} on this CPU; its kernels were not tested here ***");
    }
    isa
}

/// For tests: the AVX-512 F/BW/VL path without VNNI (which any AVX-512 CPU can run), or
/// a loud skip (a failure under `CI=true` where the CPU claims the flags).
#[doc(hidden)]
pub fn avx512_or_skip() -> Option<Isa> {
    level_or_skip(Isa::avx512, "AVX-512 F/BW/VL", &["avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"])
}

/// For tests: the AVX-512 VNNI path, or a loud skip (a failure under `CI=true` where the
/// CPU claims the flags).
#[doc(hidden)]
pub fn avx512_vnni_or_skip() -> Option<Isa> {
    let flags = ["avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"];
    level_or_skip(Isa::avx512_vnni, "AVX-512 VNNI", &flags)
}

/// For tests: the AVX-512 BF16 path, or a loud skip (a failure under `CI=true` where the
/// CPU claims the flags).
#[doc(hidden)]
pub fn avx512_bf16_or_skip() -> Option<Isa> {
    let flags = ["avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx2", "fma", "f16c"];
    level_or_skip(Isa::avx512_bf16, "AVX-512 BF16", &flags)
}

/// For tests: every path this CPU runs (the AVX-512 levels through [`avx512_bf16_or_skip`],
/// [`avx512_vnni_or_skip`] and [`avx512_or_skip`], AVX2 through [`avx2_or_skip`]),
/// portable last.
#[doc(hidden)]
pub fn isas_or_skip() -> Vec<Isa> {
    // The VNNI level runs what the BF16 level runs except bf16-weight products, which the
    // AVX-512 level runs the same widening way: where BF16 exists, VNNI adds nothing to
    // test (its detection is still checked).
    let (bf16, vnni) = (avx512_bf16_or_skip(), avx512_vnni_or_skip());
    let simd = [bf16, vnni.filter(|_| bf16.is_none()), avx512_or_skip(), avx2_or_skip()];
    simd.into_iter().flatten().chain([Isa::PORTABLE]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    trait Bits {
        fn map_bits(&self) -> Vec<u32>;
    }
    impl Bits for Vec<f32> {
        fn map_bits(&self) -> Vec<u32> {
            self.iter().map(|v| v.to_bits()).collect()
        }
    }

    /// [`exp`] and [`gelu_scalar`] stay within a few ulp of the true functions over
    /// their range, and clamp what lies beyond it.
    #[test]
    fn exp_and_gelu_are_accurate() {
        // Every millionth-step under miri (it runs this too, slowly).
        for i in (-86_999..88_000).step_by(if cfg!(miri) { 997 } else { 1 }) {
            let x = i as f32 * 1e-3;
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            assert!((got - want).abs() <= 3e-7 * want, "exp({x}) = {got}, not {want}");
        }
        assert_eq!(exp(-1e30), exp(-87.0));
        assert_eq!(exp(f32::INFINITY), exp(88.0));
        assert_eq!(exp(0.0), 1.0);
        assert!(gelu_scalar(f32::NAN).is_nan() && silu_scalar(f32::NAN).is_nan());
        for i in (-4000..4000).step_by(if cfg!(miri) { 97 } else { 1 }) {
            let x = i as f32 * 0.02;
            let (g, want) = (gelu_scalar(x), crate::backend::reference::gelu_tanh(x));
            // Miri models libm's `tanh` a few ulp off, which the reference's `1 + tanh u`
            // turns into ~ulp·|x| where tanh u ≈ −1.
            let slack = if cfg!(miri) { 4.0 * f32::EPSILON * x.abs() } else { 0.0 };
            assert!((g - want).abs() <= 1e-6 * (1.0 + want.abs()) + slack, "gelu({x}): {g} vs {want}");
        }
        for x in [1e3f32, -1e3, 3e38, -3e38] {
            assert!(gelu_scalar(x).is_finite() && silu_scalar(x).is_finite(), "{x}");
        }
    }

    /// Every level's GELU, SwiGLU, softmax and attention dot products give the portable
    /// path's bits: lengths around every vector width and tail, magnitudes from 1e-40 to
    /// 3e38, zeros of both signs, infinities and NaN.
    #[test]
    fn elementwise_ops_equal_the_portable_path_bit_for_bit() {
        let mut xs: Vec<f32> = (-3000..3000).map(|i| i as f32 * 0.0173 + (i % 7) as f32 * 1e-3).collect();
        xs.extend([1e3, -1e3, 3e38, -3e38, 0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e-40, -5.5, 87.5]);
        // NaN as one value: its sign and payload are not part of the definition (miri
        // randomises them).
        let bits = |v: &[f32]| v.iter().map(|x| if x.is_nan() { u32::MAX } else { x.to_bits() }).collect::<Vec<_>>();
        let finite: Vec<f32> = xs.iter().copied().filter(|x| x.abs() < 1e4).collect();
        for isa in isas_or_skip() {
            for len in [xs.len(), 1, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 65] {
                let (mut a, mut b) = (xs[..len].to_vec(), xs[..len].to_vec());
                gelu(isa, &mut a);
                gelu(Isa::PORTABLE, &mut b);
                assert_eq!(bits(&a), bits(&b), "{isa:?} gelu, {len} values");
                let up: Vec<f32> = xs[..len].iter().rev().copied().collect();
                let (mut a, mut b) = (vec![f32::NAN; len], vec![f32::NAN; len]);
                swiglu(isa, &xs[..len], &up, &mut a);
                swiglu(Isa::PORTABLE, &xs[..len], &up, &mut b);
                assert_eq!(bits(&a), bits(&b), "{isa:?} swiglu, {len} values");
                let lf = len.min(finite.len());
                let (mut a, mut b) = (finite[..lf].to_vec(), finite[..lf].to_vec());
                softmax(isa, &mut a);
                softmax(Isa::PORTABLE, &mut b);
                assert_eq!(bits(&a), bits(&b), "{isa:?} softmax, {len} values");
                let n = len.min(200);
                let (q, rows) = (&finite[..n], &finite[finite.len() - 3 * n..]);
                let (mut a, mut b) = (vec![f32::NAN; 3], vec![f32::NAN; 3]);
                dot_rows(isa, q, rows, 0.125, &mut a);
                dot_rows(Isa::PORTABLE, q, rows, 0.125, &mut b);
                assert_eq!(bits(&a), bits(&b), "{isa:?} dot_rows, width {n}");
            }
            // The portable bodies as an FMA-less CPU runs them (every `mul_add` a call to
            // `fmaf`) give the bits of the FMA-compiled ones that `portable` picks.
            let n = 77;
            let (q, k) = (&finite[..n], &finite[finite.len() - n..]);
            assert_eq!(dot_widened(q, k).to_bits(), portable(|| dot_widened(q, k)).to_bits());
            let (mut a, mut b) = (finite[..n].to_vec(), finite[..n].to_vec());
            assert_eq!(exp_sub_sum(&mut a, 3.0).to_bits(), portable(|| exp_sub_sum(&mut b, 3.0)).to_bits());
            assert_eq!(bits(&a), bits(&b));
            let plain: Vec<f32> = xs.iter().map(|&x| gelu_scalar(x) + silu_scalar(x)).collect();
            let fused: Vec<f32> = portable(|| xs.iter().map(|&x| gelu_scalar(x) + silu_scalar(x)).collect());
            assert_eq!(bits(&plain), bits(&fused));
            // A NaN or infinite score makes the whole softmax NaN (never hidden).
            for bad in [f32::NAN, f32::INFINITY] {
                let mut v = finite[..37].to_vec();
                v[20] = bad;
                softmax(isa, &mut v);
                assert!(v.iter().all(|p| p.is_nan()), "{isa:?} softmax with {bad}: {v:?}");
            }
        }
    }

    /// The AVX-512 GELU (16 lanes, and the fused GEMM epilogue) gives the AVX2 one's bits,
    /// tails, huge magnitudes, infinities and NaN included; both stay near the scalar one.
    #[test]
    fn avx512_gelu_equals_avx2_bit_for_bit() {
        let (Some(avx512), Some(avx2)) = (avx512_or_skip(), avx2_or_skip()) else { return };
        let mut xs: Vec<f32> = (-4000..4000).map(|i| i as f32 * 0.0173).collect();
        xs.extend([1e3, -1e3, 3e38, -3e38, 0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e-40, -5.5]);
        for len in [xs.len(), 16, 17, 31, 5] {
            let (mut a, mut b) = (xs[..len].to_vec(), xs[..len].to_vec());
            gelu(avx512, &mut a);
            gelu(avx2, &mut b);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&a), bits(&b), "gelu, {len} values");
            for (x, g) in xs.iter().zip(&a).filter(|(x, _)| x.abs() < 1e4) {
                let want = crate::backend::reference::gelu_tanh(*x);
                assert!((g - want).abs() <= 1e-6 * (1.0 + want.abs()), "gelu({x}): {g} vs {want}");
            }
        }
        #[cfg(target_arch = "x86_64")]
        for chunk in xs.chunks_exact(16).step_by(37) {
            let acc: [f32; 16] = chunk.try_into().unwrap();
            let bias: [f32; 16] = std::array::from_fn(|i| i as f32 * 0.37 - 3.0);
            for (with_bias, with_gelu) in [(false, false), (true, false), (false, true), (true, true)] {
                let mut got = [f32::NAN; 16];
                // SAFETY: AVX-512 was detected above; `got` holds 16 values.
                unsafe {
                    x86::bias_gelu_store16(&acc, with_bias.then_some(&bias), with_gelu, got.as_mut_ptr());
                }
                let mut want = acc;
                if with_bias {
                    want.iter_mut().zip(&bias).for_each(|(v, b)| *v += b);
                }
                if with_gelu {
                    gelu(avx2, &mut want);
                }
                assert_eq!(got.map(f32::to_bits), want.map(f32::to_bits), "epilogue bias {with_bias} gelu {with_gelu}");
            }
        }
    }

    /// The attention row kernels give the bits of the per-row `dot` and `axpy` loops they
    /// replace, on every path, for widths around the 8- and 64-column strips.
    #[test]
    fn row_kernels_equal_their_per_row_loops_bit_for_bit() {
        let val = |i: usize, seed: usize| {
            let h = (i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 20011;
            // Large and small magnitudes together, so any change of order shows in the bits.
            (h as f32 / 20011.0 - 0.5) * if h.is_multiple_of(7) { 1e4 } else { 1.0 }
        };
        for isa in isas_or_skip() {
            for n in [1, 7, 8, 9, 16, 24, 40, 63, 64, 65, 96, 100, 128, 129, 136, 200] {
                for n_rows in [0, 1, 5, 33] {
                    let q: Vec<f32> = (0..n).map(|i| val(i, 1)).collect();
                    let rows: Vec<f32> = (0..n * n_rows).map(|i| val(i, 2)).collect();
                    let mut got = vec![f32::NAN; n_rows];
                    dot_rows(isa, &q, &rows, 0.125, &mut got);
                    for (j, g) in got.iter().enumerate() {
                        let want = dot(isa, &q, &rows[j * n..(j + 1) * n]) * 0.125;
                        assert_eq!(g.to_bits(), want.to_bits(), "{isa:?} dot_rows n {n} row {j}");
                    }
                    let p: Vec<f32> = (0..n_rows).map(|j| val(j, 3).abs()).collect();
                    let mut got = vec![f32::NAN; n];
                    weighted_rows(isa, &p, &rows, &mut got);
                    let mut want = vec![0.0f32; n];
                    for (j, &pj) in p.iter().enumerate() {
                        axpy(isa, pj, &rows[j * n..(j + 1) * n], &mut want);
                    }
                    let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{isa:?} weighted_rows n {n} rows {n_rows}: {got:?} vs {want:?}");
                    // f16 rows (an f16 KV cache): the bits of the same calls on the rows
                    // widened to f32 first.
                    let rows16: Vec<half::f16> = rows.iter().map(|&v| half::f16::from_f32(v)).collect();
                    let widened: Vec<f32> = rows16.iter().map(|v| v.to_f32()).collect();
                    let (mut got, mut want) = (vec![f32::NAN; n_rows], vec![f32::NAN; n_rows]);
                    dot_rows(isa, &q, &rows16, 0.125, &mut got);
                    dot_rows(isa, &q, &widened, 0.125, &mut want);
                    assert_eq!(got.map_bits(), want.map_bits(), "{isa:?} f16 dot_rows n {n} rows {n_rows}");
                    let (mut got, mut want) = (vec![f32::NAN; n], vec![f32::NAN; n]);
                    weighted_rows(isa, &p, &rows16, &mut got);
                    weighted_rows(isa, &p, &widened, &mut want);
                    assert_eq!(got.map_bits(), want.map_bits(), "{isa:?} f16 weighted_rows n {n} rows {n_rows}");
                }
            }
        }
    }
}
