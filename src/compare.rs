//! Error measures for comparing two outputs (a backend against the reference, the
//! engine against HF), made so that nothing slips through: every measure propagates
//! NaN (a NaN anywhere gives NaN, and `NaN < tol` is false), an infinity where the
//! other side is finite gives an infinite error, and outputs of different lengths give
//! an infinite error instead of comparing a prefix.

/// max |a − b| over all elements; NaN if either side has a NaN; +inf when the lengths
/// differ or one side is infinite where the other is not. Equal infinities count as 0.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    if a.len() != b.len() {
        return f32::INFINITY;
    }
    let mut worst = 0f32;
    for (&x, &y) in a.iter().zip(b) {
        let d = if x == y { 0.0 } else { (x - y).abs() };
        if d.is_nan() {
            return f32::NAN;
        }
        worst = worst.max(d);
    }
    worst
}

/// `max` that keeps a NaN (`f32::max` drops it), for folding error measures.
pub fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(b) }
}

/// Normalised error of `got` against `want`, as llama.cpp's test-backend-ops measures it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ErrorStats {
    /// Σ(got − want)² / Σ want² (Σ(got − want)² when `want` is all zeros).
    pub nmse: f64,
    /// max |got − want| / max |want|.
    pub max_rel: f64,
    /// max |got − want|.
    pub max_abs: f64,
}

impl ErrorStats {
    /// Both measures within their bounds (false for NaN).
    pub fn within(&self, nmse: f64, max_rel: f64) -> bool {
        self.nmse <= nmse && self.max_rel <= max_rel
    }
}

/// [`ErrorStats`] of `got` against `want`, NaN-propagating like [`max_abs_diff`].
pub fn error_stats(got: &[f32], want: &[f32]) -> ErrorStats {
    if got.len() != want.len() {
        return ErrorStats { nmse: f64::INFINITY, max_rel: f64::INFINITY, max_abs: f64::INFINITY };
    }
    let (mut num, mut den, mut max_ref) = (0f64, 0f64, 0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = if g == w { 0.0 } else { f64::from(g) - f64::from(w) };
        num += d * d;
        den += f64::from(w) * f64::from(w);
        max_ref = max_ref.max(f64::from(w).abs());
    }
    let max_abs = f64::from(max_abs_diff(got, want));
    let nmse = if den > 0.0 { num / den } else { num };
    let max_rel = if max_abs == 0.0 { 0.0 } else { max_abs / max_ref.max(f64::MIN_POSITIVE) };
    // NaN inputs make `num` NaN; keep NaN in every field.
    if nmse.is_nan() || max_abs.is_nan() {
        return ErrorStats { nmse: f64::NAN, max_rel: f64::NAN, max_abs: f64::NAN };
    }
    ErrorStats { nmse, max_rel, max_abs }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_and_infinity_are_never_small() {
        assert_eq!(max_abs_diff(&[1.0, 2.0], &[1.0, 2.5]), 0.5);
        assert!(max_abs_diff(&[f32::NAN; 3], &[f32::NAN; 3]).is_nan());
        assert!(max_abs_diff(&[1.0, f32::NAN], &[1.0, 2.0]).is_nan());
        assert!(max_abs_diff(&[1.0, 2.0], &[f32::NAN, 2.0]).is_nan());
        assert_eq!(max_abs_diff(&[f32::INFINITY], &[1.0]), f32::INFINITY);
        assert_eq!(max_abs_diff(&[f32::INFINITY], &[f32::INFINITY]), 0.0);
        assert!(max_abs_diff(&[f32::INFINITY], &[f32::NEG_INFINITY]) == f32::INFINITY);
        assert_eq!(max_abs_diff(&[1.0], &[1.0, 2.0]), f32::INFINITY);
        let nan = error_stats(&[f32::NAN, 1.0], &[0.0, 1.0]);
        assert!(nan.nmse.is_nan() && nan.max_rel.is_nan() && nan.max_abs.is_nan());
        assert!(!nan.within(1.0, 1.0));
        assert!(!error_stats(&[1.0], &[1.0, 1.0]).within(1.0, 1.0));
        assert!(error_stats(&[1.0, 2.0], &[1.0, 2.0]).within(0.0, 0.0));
        assert!(nan_max(0.0, f32::NAN).is_nan() && nan_max(f32::NAN, 1.0).is_nan());
        assert_eq!(nan_max(1.0, 2.0), 2.0);
    }
}
