//! `batch_forge._native`: the engine `forge` runs, from Python (the `batch_forge`
//! package wraps it; docs/python.md is the guide). A `Model` owns one engine on one
//! backend and a thread pool; every call releases the GIL while it computes, and errors
//! carry the messages `forge` prints.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, Mutex};

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use batch_forge::backend::cpu::{CpuBackend, CpuOptions, physical_cores};
use batch_forge::backend::reference::ReferenceBackend;
use batch_forge::backend::{KvDtype, WeightDtype};
use batch_forge::chat::Message;
use batch_forge::engine::text::TextOut;
use batch_forge::engine::{Engine, GenerateParams, Halt, SamplingParams, TokenLogprobs};
use batch_forge::loaders::{self, hub::HubClient};

create_exception!(
    _native,
    ForgeError,
    PyRuntimeError,
    "An error from the engine: a model that cannot be loaded, a prompt that does not fit, \
     non-finite logits. The message is the one `forge` prints."
);

/// The engine on the backend the user chose (each backend is its own type). One per
/// `Model`, behind an `Arc`: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum AnyEngine {
    Cpu(Engine<CpuBackend>),
    Reference(Engine<ReferenceBackend>),
    #[cfg(feature = "gpu")]
    Gpu(Engine<batch_forge::backend::gpu::GpuBackend>),
}

/// Run `$body` with `$e` bound to the engine, whatever its backend.
macro_rules! with_engine {
    ($engine:expr, |$e:ident| $body:expr) => {
        match &*$engine {
            AnyEngine::Cpu($e) => $body,
            AnyEngine::Reference($e) => $body,
            #[cfg(feature = "gpu")]
            AnyEngine::Gpu($e) => $body,
        }
    };
}

fn forge_err(e: impl Into<anyhow::Error>) -> PyErr {
    ForgeError::new_err(format!("{:#}", e.into()))
}

/// Sampling and stopping, from keyword arguments (llama.cpp's defaults, as `forge
/// generate` and `forge serve` use).
struct Request {
    params: GenerateParams,
    stop: Vec<String>,
}

const SAMPLING_KEYS: &[&str] = &[
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "ignore_eos",
    "logprobs",
];

fn request(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Request> {
    let mut sampling = SamplingParams::default();
    let mut params = GenerateParams::greedy(256);
    let mut stop = Vec::new();
    if let Some(kwargs) = kwargs {
        for (key, value) in kwargs.iter() {
            let key: String = key.extract()?;
            if value.is_none() {
                continue; // an explicit None keeps the default
            }
            let bad = |e: PyErr| PyTypeError::new_err(format!("{key}: {e}"));
            match key.as_str() {
                "max_tokens" => params.max_new_tokens = value.extract().map_err(bad)?,
                "temperature" => sampling.temperature = value.extract().map_err(bad)?,
                "top_k" => sampling.top_k = value.extract().map_err(bad)?,
                "top_p" => sampling.top_p = value.extract().map_err(bad)?,
                "min_p" => sampling.min_p = value.extract().map_err(bad)?,
                "repeat_penalty" => sampling.repeat_penalty = value.extract().map_err(bad)?,
                "repeat_last_n" => {
                    // llama.cpp's -1: the whole context.
                    let n: i64 = value.extract().map_err(bad)?;
                    sampling.repeat_last_n = match n {
                        -1 => usize::MAX,
                        n if n >= 0 => n as usize,
                        _ => return Err(PyValueError::new_err(format!("repeat_last_n must be >= -1, got {n}"))),
                    };
                }
                "presence_penalty" => sampling.presence_penalty = value.extract().map_err(bad)?,
                "frequency_penalty" => sampling.frequency_penalty = value.extract().map_err(bad)?,
                "seed" => sampling.seed = value.extract().map_err(bad)?,
                "stop" => {
                    stop = match value.extract::<String>() {
                        Ok(s) => vec![s],
                        Err(_) => value.extract().map_err(bad)?,
                    };
                    if stop.iter().any(String::is_empty) {
                        return Err(PyValueError::new_err("stop strings must not be empty"));
                    }
                }
                "ignore_eos" => params.ignore_eos = value.extract().map_err(bad)?,
                "logprobs" => params.logprobs = Some(value.extract().map_err(bad)?),
                _ => {
                    return Err(PyTypeError::new_err(format!(
                        "unexpected keyword argument {key:?} (sampling takes {})",
                        SAMPLING_KEYS.join(", ")
                    )));
                }
            }
        }
    }
    sampling.validate().map_err(|e| PyValueError::new_err(e.api_message()))?;
    params.sampling = sampling;
    Ok(Request { params, stop })
}

/// A prompt: text (tokenized as `forge generate` does, BOS first where the model wants
/// one) or token ids.
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

impl<'a, 'py> FromPyObject<'a, 'py> for Prompt {
    type Error = PyErr;
    fn extract(ob: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(s) = ob.extract::<String>() {
            return Ok(Prompt::Text(s));
        }
        ob.extract::<Vec<u32>>()
            .map(Prompt::Ids)
            .map_err(|_| PyTypeError::new_err("a prompt is a str or a list of token ids (ints >= 0)"))
    }
}

/// One finished generation.
#[pyclass(frozen, get_all, module = "batch_forge")]
struct Completion {
    /// The generated text (cut before a stop string).
    text: String,
    /// The generated token ids.
    token_ids: Vec<u32>,
    /// The prompt's token ids, as the model saw them.
    prompt_token_ids: Vec<u32>,
    /// `"length"` (max_tokens), `"eos"` (an end-of-generation token), `"stop"` (a stop
    /// string) or `"context_full"`.
    finish_reason: &'static str,
    /// Each generated token's log-probability, when `logprobs` was given.
    logprobs: Option<Vec<f64>>,
    /// The `logprobs` most likely alternatives at each step: (token id, log-probability).
    top_logprobs: Option<Vec<Vec<(u32, f64)>>>,
}

#[pymethods]
impl Completion {
    fn __repr__(&self) -> String {
        format!(
            "Completion(text={:?}, tokens={}, finish_reason={:?})",
            self.text,
            self.token_ids.len(),
            self.finish_reason
        )
    }
}

/// A model loaded on a backend: GPT-2, Llama-family (Llama, SmolLM2, Qwen 2/3) or Gemma 3,
/// from a GGUF file, an HF folder or a Hub id.
#[pyclass(frozen, module = "batch_forge")]
struct Model {
    engine: Arc<AnyEngine>,
    pool: Arc<rayon::ThreadPool>,
    path: PathBuf,
}

impl Model {
    /// Run `f` on the model's threads with the GIL released.
    fn compute<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&AnyEngine) -> anyhow::Result<R> + Send) -> PyResult<R> {
        let (engine, pool) = (&self.engine, &self.pool);
        py.detach(|| pool.install(|| f(engine))).map_err(forge_err)
    }

    fn vocab_size(&self) -> usize {
        with_engine!(self.engine, |e| e.model.info().vocab_size)
    }

    fn prompt_ids(&self, prompt: Prompt) -> PyResult<Vec<u32>> {
        match prompt {
            Prompt::Text(text) => Ok(with_engine!(self.engine, |e| e.prompt_ids(&text))),
            Prompt::Ids(ids) => {
                self.check_ids(&ids)?;
                Ok(ids)
            }
        }
    }

    fn check_ids(&self, ids: &[u32]) -> PyResult<()> {
        let vocab = self.vocab_size();
        match ids.iter().find(|&&id| id as usize >= vocab) {
            Some(id) => Err(PyValueError::new_err(format!("token id {id} is outside the vocabulary (0..{vocab})"))),
            None => Ok(()),
        }
    }

    fn run(&self, py: Python<'_>, ids: Vec<u32>, req: Request) -> PyResult<Completion> {
        let Request { params, stop } = req;
        self.compute(py, move |engine| {
            with_engine!(engine, |e| {
                let mut text = TextOut::new(&e.text.tokenizer, &stop);
                let result =
                    e.generate(&ids, &params, |id| if text.push(id, None) { Err(Halt::Stop) } else { Ok(()) })?;
                text.finish();
                let top = params.logprobs.is_some();
                Ok(Completion {
                    text: text.text().to_owned(),
                    token_ids: result.generated_ids,
                    prompt_token_ids: result.prompt_ids,
                    finish_reason: result.stop.as_str(),
                    logprobs: top.then(|| result.logprobs.iter().map(|t| t.logprob).collect()),
                    top_logprobs: top.then(|| result.logprobs.iter().map(|t| t.top.clone()).collect()),
                })
            })
        })
    }

    fn score_ids(&self, py: Python<'_>, ids: Vec<u32>, top: usize) -> PyResult<Vec<TokenLogprobs>> {
        self.compute(py, move |engine| with_engine!(engine, |e| Ok(e.score(&ids, top)?)))
    }
}

#[pymethods]
impl Model {
    /// Load a model. `backend`: "cpu" (default), "reference" or "gpu"; `threads`: worker
    /// threads (default: the physical cores); `dtype`: weight storage "f32", "f16" or
    /// "bf16" (default: the file's); `kv_dtype`: "f32" (default) or "f16";
    /// `batch_invariant` (default True): the server's kernels, so scoring a text and
    /// generating it give the same bits, and so does `forge serve`.
    #[new]
    #[pyo3(signature = (path, *, backend = "cpu", threads = None, dtype = None, kv_dtype = "f32", batch_invariant = true))]
    fn new(
        py: Python<'_>,
        path: &str,
        backend: &str,
        threads: Option<usize>,
        dtype: Option<&str>,
        kv_dtype: &str,
        batch_invariant: bool,
    ) -> PyResult<Self> {
        let weight_dtype = match dtype {
            None => None,
            Some("f32") => Some(WeightDtype::F32),
            Some("f16") => Some(WeightDtype::F16),
            Some("bf16") => Some(WeightDtype::BF16),
            Some(d) => {
                return Err(PyValueError::new_err(format!("dtype must be \"f32\", \"f16\" or \"bf16\", got {d:?}")));
            }
        };
        let kv_dtype = match kv_dtype {
            "f32" => KvDtype::F32,
            "f16" => KvDtype::F16,
            d => return Err(PyValueError::new_err(format!("kv_dtype must be \"f32\" or \"f16\", got {d:?}"))),
        };
        if backend == "reference" && (weight_dtype.is_some() || kv_dtype != KvDtype::F32) {
            return Err(PyValueError::new_err(
                "the reference backend computes in f32 only; dtype and kv_dtype apply to cpu",
            ));
        }
        if !["cpu", "reference", "gpu"].contains(&backend) {
            return Err(PyValueError::new_err(format!(
                "backend must be \"cpu\", \"reference\" or \"gpu\", got {backend:?}"
            )));
        }
        let threads = threads.unwrap_or_else(physical_cores);
        if threads == 0 {
            return Err(PyValueError::new_err("threads must be at least 1"));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("batch_forge-{i}"))
            .build()
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        let backend = backend.to_owned();
        let path = path.to_owned();
        let (engine, dir) = py
            .detach(|| {
                pool.install(|| -> anyhow::Result<(AnyEngine, PathBuf)> {
                    let dir = loaders::resolve_model(&path, &HubClient::from_env(), true, "generate")?;
                    let cpu = CpuOptions { weight_dtype, kv_dtype, batch_invariant, ..CpuOptions::default() };
                    let engine = match backend.as_str() {
                        "cpu" => AnyEngine::Cpu(Engine::load(CpuBackend::new(cpu)?, &dir)?),
                        "reference" => AnyEngine::Reference(Engine::load(ReferenceBackend, &dir)?),
                        "gpu" => {
                            #[cfg(feature = "gpu")]
                            {
                                let opts = batch_forge::backend::gpu::GpuOptions {
                                    weight_dtype,
                                    kv_dtype,
                                    batch_invariant,
                                    ..Default::default()
                                };
                                AnyEngine::Gpu(Engine::load(batch_forge::backend::gpu::GpuBackend::new(opts)?, &dir)?)
                            }
                            #[cfg(not(feature = "gpu"))]
                            anyhow::bail!("this batch_forge was built without GPU support")
                        }
                        other => anyhow::bail!("backend must be \"cpu\", \"reference\" or \"gpu\", got {other:?}"),
                    };
                    Ok((engine, dir))
                })
            })
            .map_err(forge_err)?;
        Ok(Model { engine: Arc::new(engine), pool: Arc::new(pool), path: dir })
    }

    /// Generate from a prompt (str or token ids); the generated text. Keyword arguments:
    /// max_tokens (256), temperature (0.8; 0 = greedy), top_k (40), top_p (0.95), min_p
    /// (0.05), repeat_penalty (1.0), repeat_last_n (64), presence_penalty (0),
    /// frequency_penalty (0), seed (0), stop (str or list), ignore_eos (False).
    #[pyo3(signature = (prompt, **sampling))]
    fn generate(&self, py: Python<'_>, prompt: Prompt, sampling: Option<&Bound<'_, PyDict>>) -> PyResult<String> {
        let req = request(sampling)?;
        Ok(self.run(py, self.prompt_ids(prompt)?, req)?.text)
    }

    /// As `generate`, with the token ids, the finish reason and (with `logprobs=N`) each
    /// token's log-probability and N alternatives.
    #[pyo3(signature = (prompt, **sampling))]
    fn complete(&self, py: Python<'_>, prompt: Prompt, sampling: Option<&Bound<'_, PyDict>>) -> PyResult<Completion> {
        let req = request(sampling)?;
        self.run(py, self.prompt_ids(prompt)?, req)
    }

    /// As `generate`, as an iterator of text pieces (whole characters; a stop string and
    /// what could begin one are held back until decided). Dropping the iterator stops
    /// the generation.
    #[pyo3(signature = (prompt, **sampling))]
    fn stream(&self, prompt: Prompt, sampling: Option<&Bound<'_, PyDict>>) -> PyResult<Stream> {
        let Request { params, stop } = request(sampling)?;
        let ids = self.prompt_ids(prompt)?;
        let (tx, rx) = channel::<Result<String, String>>();
        let (engine, pool) = (self.engine.clone(), self.pool.clone());
        std::thread::Builder::new()
            .name("batch_forge-stream".into())
            .spawn(move || {
                let failed = tx.clone();
                let run = std::panic::AssertUnwindSafe(|| {
                    pool.install(|| {
                        with_engine!(engine, |e| {
                            let mut text = TextOut::new(&e.text.tokenizer, &stop);
                            let result = e.generate(&ids, &params, |id| {
                                let stopped = text.push(id, None);
                                let (piece, _) = text.take_ready(false);
                                // The reader is gone (the iterator was dropped): stop.
                                if !piece.is_empty() && tx.send(Ok(piece)).is_err() {
                                    return Err(Halt::Stop);
                                }
                                if stopped { Err(Halt::Stop) } else { Ok(()) }
                            });
                            match result {
                                Ok(_) => {
                                    text.finish();
                                    let (piece, _) = text.take_ready(true);
                                    if !piece.is_empty() {
                                        let _ = tx.send(Ok(piece));
                                    }
                                }
                                Err(e) => {
                                    let _ = tx.send(Err(format!("{e:#}")));
                                }
                            }
                        })
                    })
                });
                // A panic is an error the reader sees, not a stream that silently ends.
                if std::panic::catch_unwind(run).is_err() {
                    let _ = failed.send(Err("the generation panicked (a bug: please report it)".into()));
                }
            })
            .map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
        Ok(Stream { rx: Mutex::new(rx) })
    }

    /// Answer a conversation (a list of {"role", "content"} dicts) through the model's
    /// chat template; the reply's text. Sampling as in `generate`.
    #[pyo3(signature = (messages, **sampling))]
    fn chat(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyList>,
        sampling: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<String> {
        let mut msgs = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let get = |k: &str| -> PyResult<String> {
                m.get_item(k)
                    .and_then(|v| v.extract::<String>())
                    .map_err(|_| PyValueError::new_err(format!("messages[{i}] needs a string {k:?}")))
            };
            msgs.push(Message::new(&get("role")?, &get("content")?));
        }
        let req = request(sampling)?;
        let ids = with_engine!(self.engine, |e| e.chat_prompt_ids(&msgs)).map_err(forge_err)?;
        Ok(self.run(py, ids, req)?.text)
    }

    /// Token ids of a text; `add_special` puts the model's BOS first where it wants one
    /// (as prompts get it).
    #[pyo3(signature = (text, *, add_special = true))]
    fn tokenize(&self, text: &str, add_special: bool) -> Vec<u32> {
        with_engine!(self.engine, |e| if add_special { e.prompt_ids(text) } else { e.text.tokenizer.encode(text) })
    }

    /// The text of token ids.
    fn detokenize(&self, ids: Vec<u32>) -> PyResult<String> {
        self.check_ids(&ids)?;
        with_engine!(self.engine, |e| e.text.tokenizer.decode(&ids))
            .map_err(|e| PyValueError::new_err(format!("{e:#}")))
    }

    /// The log-probability of every token of `prompt` after the first, given the ones
    /// before it (a str gets the model's BOS first where it wants one).
    fn score(&self, py: Python<'_>, prompt: Prompt) -> PyResult<Vec<f64>> {
        let ids = self.prompt_ids(prompt)?;
        Ok(self.score_ids(py, ids, 0)?.into_iter().map(|t| t.logprob).collect())
    }

    /// lm-eval's loglikelihood: the summed log-probability of `continuation` after
    /// `context`, and whether greedy decoding would have produced it. Texts are encoded
    /// as lm-eval encodes a pair: the context's trailing spaces move to the continuation,
    /// the whole is tokenized, and the continuation is what follows the context's own
    /// tokens (BOS first where the model wants one). Token ids are joined as given.
    fn loglikelihood(&self, py: Python<'_>, context: Prompt, continuation: Prompt) -> PyResult<(f64, bool)> {
        let (ctx, cont) = match (context, continuation) {
            (Prompt::Text(context), Prompt::Text(continuation)) => {
                let kept = context.trim_end_matches(' ').len();
                let (context, continuation) = (&context[..kept], format!("{}{continuation}", &context[kept..]));
                with_engine!(self.engine, |e| {
                    let whole = e.prompt_ids(&format!("{context}{continuation}"));
                    let ctx = e.prompt_ids(context);
                    let split = ctx.len().min(whole.len());
                    (whole[..split].to_vec(), whole[split..].to_vec())
                })
            }
            (context, continuation) => {
                let ctx = self.prompt_ids(context)?;
                let cont = match continuation {
                    Prompt::Text(t) => with_engine!(self.engine, |e| e.text.tokenizer.encode(&t)),
                    Prompt::Ids(ids) => {
                        self.check_ids(&ids)?;
                        ids
                    }
                };
                (ctx, cont)
            }
        };
        if ctx.is_empty() {
            return Err(PyValueError::new_err("the context is empty (and the model has no BOS token to start from)"));
        }
        if cont.is_empty() {
            return Err(PyValueError::new_err("the continuation is empty"));
        }
        let n = cont.len();
        let scored = self.score_ids(py, [ctx, cont].concat(), 1)?;
        let tail = &scored[scored.len() - n..];
        let sum = tail.iter().map(|t| t.logprob).sum();
        let greedy = tail.iter().all(|t| t.top.first().is_some_and(|&(id, _)| id == t.id));
        Ok((sum, greedy))
    }

    /// "gpt2", "llama", "gemma3".
    #[getter]
    fn architecture(&self) -> &'static str {
        with_engine!(self.engine, |e| e.model.info().architecture)
    }

    #[getter(vocab_size)]
    fn get_vocab_size(&self) -> usize {
        self.vocab_size()
    }

    /// Positions the model was trained for.
    #[getter]
    fn context_length(&self) -> usize {
        with_engine!(self.engine, |e| e.model.info().context_length)
    }

    #[getter]
    fn n_params(&self) -> usize {
        with_engine!(self.engine, |e| e.model.info().n_params)
    }

    /// Tokens that end generation.
    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        with_engine!(self.engine, |e| e.model.info().eos_token_ids.clone())
    }

    /// "cpu", "reference" or "gpu".
    #[getter]
    fn backend(&self) -> String {
        use batch_forge::backend::Backend as _;
        with_engine!(self.engine, |e| e.backend.name())
    }

    /// The folder or file the model was loaded from (a Hub id resolved to its cache).
    #[getter]
    fn path(&self) -> String {
        self.path.display().to_string()
    }

    fn __repr__(&self) -> String {
        format!("Model({:?}, architecture={:?}, backend={:?})", self.path(), self.architecture(), self.backend())
    }
}

/// The text pieces of a streamed generation.
#[pyclass(module = "batch_forge")]
struct Stream {
    rx: Mutex<Receiver<Result<String, String>>>,
}

#[pymethods]
impl Stream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let next = py.detach(|| self.rx.lock().map(|rx| rx.recv()).map_err(|_| ()));
        match next {
            Ok(Ok(Ok(piece))) => Ok(Some(piece)),
            Ok(Ok(Err(e))) => Err(ForgeError::new_err(e)),
            Ok(Err(_)) => Ok(None), // the generation ended: StopIteration
            Err(_) => Err(PyRuntimeError::new_err("the stream's lock was poisoned")),
        }
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Model>()?;
    m.add_class::<Completion>()?;
    m.add_class::<Stream>()?;
    m.add("ForgeError", m.py().get_type::<ForgeError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
