//! The engine's counters and latency histograms (the scheduler updates them), rendered
//! as Prometheus text for `GET /metrics`.

use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::prefix_cache::BLOCK_TOKENS;

/// A Prometheus histogram over fixed buckets (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (non-cumulative), then the sum and the count.
    state: Mutex<(Vec<u64>, f64, u64)>,
}

/// Latency buckets from 1 ms to 60 s.
const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, state: Mutex::new((vec![0; bounds.len()], 0.0, 0)) }
    }

    pub fn observe(&self, v: f64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            s.0[i] += 1;
        }
        s.1 += v;
        s.2 += 1;
    }

    pub fn count(&self) -> u64 {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).2
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, n) in self.bounds.iter().zip(&s.0) {
            cum += n;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}", s.2, s.1, s.2);
    }
}

/// A Prometheus label value: backslash, double quote and newline escaped.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// The scheduler's state after a step, published as one snapshot so that `/metrics`
/// never shows one gauge from before a step beside another from after it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Gauges {
    /// Sequences being decoded or prefilled.
    pub running: u64,
    /// Requests waiting for a slot or KV blocks.
    pub waiting: u64,
    /// KV blocks held, by running sequences and the prefix cache together.
    pub kv_blocks_used: u64,
    /// KV blocks held by the prefix cache.
    pub kv_blocks_cached: u64,
}

/// Everything `/metrics` reports; written by the scheduler and the HTTP layer.
pub struct Metrics {
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub gauges: Mutex<Gauges>,
    pub requests_ok: AtomicU64,
    pub requests_rejected: AtomicU64,
    pub requests_cancelled: AtomicU64,
    pub kv_blocks_total: AtomicU64,
    pub prefix_cache_hits: AtomicU64,
    pub prefix_cache_hit_tokens: AtomicU64,
    /// The most sequences one forward has held.
    pub batch_sequences_max: AtomicU64,
    /// Forward passes run.
    pub steps: AtomicU64,
    /// Speculative decoding: drafts verified, their tokens, and the tokens accepted.
    pub spec_drafts: AtomicU64,
    pub spec_draft_tokens: AtomicU64,
    pub spec_accepted_tokens: AtomicU64,
    /// Time to first token (from arrival at the scheduler).
    pub ttft: Histogram,
    /// Inter-token latency.
    pub itl: Histogram,
    /// Whole request, arrival to last event.
    pub e2e: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            gauges: Mutex::new(Gauges::default()),
            requests_ok: AtomicU64::new(0),
            requests_rejected: AtomicU64::new(0),
            requests_cancelled: AtomicU64::new(0),
            kv_blocks_total: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            prefix_cache_hit_tokens: AtomicU64::new(0),
            batch_sequences_max: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            spec_drafts: AtomicU64::new(0),
            spec_draft_tokens: AtomicU64::new(0),
            spec_accepted_tokens: AtomicU64::new(0),
            ttft: Histogram::new(LATENCY_BUCKETS),
            itl: Histogram::new(LATENCY_BUCKETS),
            e2e: Histogram::new(LATENCY_BUCKETS),
        }
    }
}

impl Metrics {
    pub fn publish(&self, g: Gauges) {
        *self.gauges.lock().unwrap_or_else(|e| e.into_inner()) = g;
    }

    pub fn gauges(&self) -> Gauges {
        *self.gauges.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The Prometheus text exposition (format 0.0.4), without a model name.
    pub fn render(&self) -> String {
        self.render_for("")
    }

    /// The Prometheus text exposition (format 0.0.4): forge's own names, then the
    /// vLLM names that routers read (the Gateway API Inference Extension's model-server
    /// protocol: queued and running requests, KV-cache usage, the cache's block layout),
    /// labelled with `model_name` as vLLM labels them.
    pub fn render_for(&self, model_name: &str) -> String {
        let mut out = String::new();
        let g = self.gauges();
        let (running, waiting, used, cached) = (
            AtomicU64::new(g.running),
            AtomicU64::new(g.waiting),
            AtomicU64::new(g.kv_blocks_used),
            AtomicU64::new(g.kv_blocks_cached),
        );
        let counters: [(&str, &str, &str, &AtomicU64); 17] = [
            ("forge_prompt_tokens_total", "counter", "Prompt tokens admitted.", &self.prompt_tokens),
            ("forge_generation_tokens_total", "counter", "Tokens generated.", &self.generation_tokens),
            ("forge_requests_running", "gauge", "Sequences being decoded or prefilled.", &running),
            ("forge_requests_waiting", "gauge", "Requests waiting for a slot or KV blocks.", &waiting),
            ("forge_requests_success_total", "counter", "Requests answered in full.", &self.requests_ok),
            ("forge_requests_rejected_total", "counter", "Requests answered with an error.", &self.requests_rejected),
            ("forge_requests_cancelled_total", "counter", "Requests whose client went away.", &self.requests_cancelled),
            ("forge_kv_blocks_used", "gauge", "KV blocks held (running sequences and the prefix cache).", &used),
            ("forge_kv_blocks_cached", "gauge", "KV blocks held by the prefix cache.", &cached),
            ("forge_kv_blocks_total", "gauge", "KV blocks in the pool.", &self.kv_blocks_total),
            (
                "forge_prefix_cache_hits_total",
                "counter",
                "Requests that reused cached prompt blocks.",
                &self.prefix_cache_hits,
            ),
            (
                "forge_prefix_cache_hit_tokens_total",
                "counter",
                "Prompt tokens reused from the prefix cache.",
                &self.prefix_cache_hit_tokens,
            ),
            (
                "forge_batch_sequences_max",
                "gauge",
                "The most sequences one forward has held.",
                &self.batch_sequences_max,
            ),
            ("forge_steps_total", "counter", "Forward passes (scheduler steps) run.", &self.steps),
            (
                "forge_spec_decode_num_drafts_total",
                "counter",
                "Drafts verified (speculative decoding).",
                &self.spec_drafts,
            ),
            ("forge_spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified.", &self.spec_draft_tokens),
            (
                "forge_spec_decode_num_accepted_tokens_total",
                "counter",
                "Draft tokens accepted (each is a token plain decoding picks too).",
                &self.spec_accepted_tokens,
            ),
        ];
        for (name, kind, help, v) in counters {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}", v.load(Ordering::Relaxed));
        }
        self.ttft.render(&mut out, "forge_time_to_first_token_seconds", "Time to first token.");
        self.itl.render(&mut out, "forge_inter_token_latency_seconds", "Time between consecutive tokens.");
        self.e2e.render(&mut out, "forge_request_duration_seconds", "Request duration, arrival to last token.");
        let total = self.kv_blocks_total.load(Ordering::Relaxed);
        if total == 0 {
            return out; // no model loaded yet: no pool to describe to a router
        }
        let label = format!("model_name=\"{}\"", escape_label(model_name));
        // Blocks reserved by running sequences; prefix-cache entries are evictable, so
        // they count as free (as vLLM counts its cached blocks with no reference).
        let reserved = g.kv_blocks_used.saturating_sub(g.kv_blocks_cached);
        let usage = reserved as f64 / total as f64;
        let vllm: [(&str, &str, String); 3] = [
            ("vllm:num_requests_running", "Requests being decoded or prefilled.", g.running.to_string()),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", g.waiting.to_string()),
            ("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is reserved.", usage.to_string()),
        ];
        for (name, help, value) in vllm {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{label}}} {value}");
        }
        let _ = writeln!(
            out,
            "# HELP vllm:cache_config_info The KV cache's layout.\n# TYPE vllm:cache_config_info gauge\n\
             vllm:cache_config_info{{{label},block_size=\"{BLOCK_TOKENS}\",num_gpu_blocks=\"{total}\"}} 1"
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_render_cumulative_buckets() {
        let m = Metrics::default();
        m.ttft.observe(0.003);
        m.ttft.observe(0.2);
        m.ttft.observe(100.0);
        m.prompt_tokens.store(42, Ordering::Relaxed);
        let text = m.render();
        assert!(text.contains("forge_prompt_tokens_total 42\n"), "{text}");
        assert!(text.contains("forge_time_to_first_token_seconds_bucket{le=\"0.005\"} 1\n"), "{text}");
        assert!(text.contains("forge_time_to_first_token_seconds_bucket{le=\"0.25\"} 2\n"), "{text}");
        assert!(text.contains("forge_time_to_first_token_seconds_bucket{le=\"+Inf\"} 3\n"), "{text}");
        assert!(text.contains("forge_time_to_first_token_seconds_count 3\n"), "{text}");
    }

    #[test]
    fn router_names_appear_with_a_pool_and_escape_their_label() {
        let m = Metrics::default();
        assert!(!m.render_for("x").contains("vllm:"), "no pool yet, no router names");
        m.kv_blocks_total.store(8, Ordering::Relaxed);
        m.publish(Gauges { running: 1, waiting: 2, kv_blocks_used: 5, kv_blocks_cached: 2 });
        let text = m.render_for("a \"b\" \\ c\nd");
        let label = r#"model_name="a \"b\" \\ c\nd""#;
        assert!(text.contains(&format!("vllm:num_requests_running{{{label}}} 1\n")), "{text}");
        assert!(text.contains(&format!("vllm:num_requests_waiting{{{label}}} 2\n")), "{text}");
        assert!(text.contains(&format!("vllm:kv_cache_usage_perc{{{label}}} 0.375\n")), "{text}");
        assert!(
            text.contains(&format!("vllm:cache_config_info{{{label},block_size=\"16\",num_gpu_blocks=\"8\"}} 1\n")),
            "{text}"
        );
    }
}
