//! From files to a model: an HF model folder (config.json + safetensors) or a GGUF file,
//! dispatched on the architecture the files declare. The engine gets a
//! [`CausalLm`] and never learns which one it was.

use std::path::{Path, PathBuf};

use crate::backend::Backend;
use crate::chat::{ChatTemplate, Message, TemplateError};
use crate::loaders::checkpoint::WeightError;
use crate::loaders::gguf::GgufFile;
pub use crate::loaders::is_gguf;
use crate::loaders::{WeightStore, Weights};
use crate::model::{Architecture, CausalLm, Gemma3, Gpt2, Llama};
use crate::tokenizer::Tokenizer;

/// Why a model could not be loaded, by whose fault: the path, the files' declared
/// architecture, their configuration, the tokenizer, or the weights.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{}: no config.json (is this a model folder?)", path.display())]
    NotAModel { path: PathBuf },
    // (Causes are in the message, not `source()`: printing the chain would repeat them.)
    #[error("cannot read {}: {cause}", path.display())]
    Read { path: PathBuf, cause: std::io::Error },
    /// The files name an architecture this engine does not run.
    #[error("{}: {what} {name:?} is not supported (supported: {supported})", path.display())]
    Unsupported { path: PathBuf, what: &'static str, name: String, supported: String },
    #[error("{}: no general.architecture in the metadata", path.display())]
    NoArchitecture { path: PathBuf },
    /// A configuration the architecture refuses (sizes, RoPE, layer kinds, ...).
    #[error("{}: {message}", path.display())]
    Config { path: PathBuf, message: String },
    #[error(transparent)]
    Gguf(#[from] crate::loaders::gguf::GgufError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error("the tokenizer has {tokenizer} ids but the model only {model}")]
    VocabMismatch { tokenizer: usize, model: usize },
    /// Tensors missing, misshapen or unreadable, or the backend could not take them.
    #[error("loading weights from {}: {cause}", path.display())]
    Weights { path: PathBuf, cause: WeightError },
}

/// One architecture as the loader sees it (see [`Architecture`]).
pub struct Entry<B: Backend> {
    pub gguf_names: &'static [&'static str],
    pub hf_model_types: &'static [&'static str],
    /// The config alone, checked before any weight is opened.
    check_hf: fn(&str) -> Result<(), String>,
    check_gguf: fn(&GgufFile) -> Result<(), String>,
    from_hf: fn(&B, &str, Weights) -> Built<B>,
    from_gguf: fn(&B, Weights) -> Built<B>,
}

/// A loaded model, or where loading it failed.
type Built<B> = Result<Box<dyn CausalLm<B>>, LoadStep>;

/// Where loading failed: reading the config, or loading the weights.
enum LoadStep {
    Config(String),
    Weights(WeightError),
}

fn entry<B: Backend, A: Architecture<B>>() -> Entry<B> {
    fn boxed<B: Backend, A: Architecture<B>>(
        backend: &B,
        config: Result<A::Config, String>,
        weights: &Weights,
    ) -> Built<B> {
        let config = config.map_err(LoadStep::Config)?;
        Ok(Box::new(A::load(backend, config, weights).map_err(LoadStep::Weights)?))
    }
    Entry {
        gguf_names: A::GGUF_NAMES,
        hf_model_types: A::HF_MODEL_TYPES,
        check_hf: |json| A::config_from_hf(json).map(drop),
        check_gguf: |file| A::config_from_gguf(file).map(drop),
        from_hf: |backend, json, weights| boxed::<B, A>(backend, A::config_from_hf(json), &weights),
        from_gguf: |backend, weights| {
            let config = match &weights {
                Weights::Gguf(file) => A::config_from_gguf(file),
                Weights::Safetensors(_) => Err("not a GGUF file".into()),
            };
            boxed::<B, A>(backend, config, &weights)
        },
    }
}

/// Every architecture this engine runs: adding one is one line here (and its file).
pub fn registry<B: Backend>() -> Vec<Entry<B>> {
    vec![entry::<B, Gpt2<B>>(), entry::<B, Llama<B>>(), entry::<B, Gemma3<B>>()]
}

/// The GGUF architecture names the registry runs, for messages.
pub fn architectures<B: Backend>() -> Vec<&'static str> {
    registry::<B>().iter().flat_map(|e| e.gguf_names.iter().copied()).collect()
}

/// A model with what comes with it in its files.
pub struct Loaded<B: Backend> {
    pub model: Box<dyn CausalLm<B>>,
    pub text: ModelText,
}

/// The text side of a model, from its files: what turns text and conversations into
/// token ids and ids back into text, and which ids end generation. The engine holds it
/// beside the model; the server's HTTP side holds it alone (the model stays on the
/// scheduler's thread).
pub struct ModelText {
    pub tokenizer: Tokenizer,
    /// The model's chat template, if its files carry one that compiles.
    pub chat_template: Option<ChatTemplate>,
    /// Why the files' chat template is unusable (it does not compile): the model still
    /// loads and generates; only chat needs the template.
    pub chat_template_error: Option<String>,
    /// Tokens that end generation: the model's EOS ids, and (as llama.cpp does) the
    /// end-of-turn tokens its vocabulary names (`<|im_end|>`, `<|eot_id|>`, …).
    pub end_of_generation: Vec<u32>,
    /// The model's BOS token: an empty prompt starts from it.
    pub bos_token_id: Option<u32>,
}

impl ModelText {
    /// The token ids of a prompt as the model expects them: the tokenizer's ids, after the
    /// BOS token when the model's files ask for one (GGUF `add_bos_token`); an empty prompt
    /// is the BOS token alone (GPT-2's `<|endoftext|>`).
    pub fn prompt_ids(&self, text: &str) -> Vec<u32> {
        let mut ids = self.encode_with_bos(text);
        if ids.is_empty()
            && let Some(bos) = self.bos_token_id
        {
            ids.push(bos);
        }
        ids
    }

    /// The tokenizer's ids after the BOS token when the model's files ask for one (an
    /// empty text stays empty: llama-server's `/tokenize`).
    pub fn encode_with_bos(&self, text: &str) -> Vec<u32> {
        let mut ids: Vec<u32> = self.tokenizer.bos_to_add().into_iter().collect();
        ids.extend(self.tokenizer.encode(text));
        ids
    }

    /// The token ids of a conversation rendered with the model's chat template, ending
    /// with the assistant's turn opened (`add_generation_prompt`). The text is encoded as
    /// HF's `apply_chat_template` does: special-token text becomes its id, and nothing is
    /// added (the template writes any BOS itself).
    pub fn chat_prompt_ids(&self, messages: &[Message]) -> Result<Vec<u32>, TemplateError> {
        let template = match (&self.chat_template, &self.chat_template_error) {
            (Some(t), _) => t,
            (None, Some(e)) => return Err(TemplateError::Unusable(e.clone())),
            (None, None) => return Err(TemplateError::Missing),
        };
        Ok(self.tokenizer.encode(&template.render(messages, true)?))
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.end_of_generation.contains(&id)
    }
}

/// Load the model, its tokenizer and chat template from a model folder or a `.gguf` file.
pub fn load_model<B: Backend>(backend: &B, path: &Path) -> Result<Loaded<B>, LoadError> {
    if is_gguf(path) {
        return load_gguf(backend, path);
    }
    let config_path = path.join("config.json");
    if !config_path.is_file() {
        return Err(LoadError::NotAModel { path: path.to_owned() });
    }
    let text =
        std::fs::read_to_string(&config_path).map_err(|cause| LoadError::Read { path: config_path.clone(), cause })?;
    let model_type = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("model_type").and_then(|t| t.as_str()).map(str::to_owned));
    // GPT-2 configs from old exports may lack model_type.
    let model_type = model_type.unwrap_or_else(|| "gpt2".to_owned());
    let registry = registry::<B>();
    let Some(arch) = registry.iter().find(|e| e.hf_model_types.contains(&model_type.as_str())) else {
        let known: Vec<&str> = registry.iter().flat_map(|e| e.hf_model_types.iter().copied()).collect();
        return Err(LoadError::Unsupported {
            path: config_path,
            what: "model_type",
            name: model_type,
            supported: known.join(", "),
        });
    };
    (arch.check_hf)(&text).map_err(|message| LoadError::Config { path: config_path.clone(), message })?;
    let weights_error = |cause| LoadError::Weights { path: path.to_owned(), cause };
    let weights = Weights::Safetensors(WeightStore::open_dir(path).map_err(weights_error)?);
    let _progress = weights.show_progress(path);
    let model = (arch.from_hf)(backend, &text, weights).map_err(|e| match e {
        LoadStep::Config(message) => LoadError::Config { path: config_path.clone(), message },
        LoadStep::Weights(cause) => weights_error(cause),
    })?;
    let tokenizer = Tokenizer::from_dir(path)?;
    let chat_template = ChatTemplate::from_dir(path).map_err(|e| format!("{}: chat template: {e}", path.display()));
    finish(model, tokenizer, chat_template, &[])
}

fn load_gguf<B: Backend>(backend: &B, path: &Path) -> Result<Loaded<B>, LoadError> {
    let file = GgufFile::open(path)?;
    let arch = file.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("").to_owned();
    let registry = registry::<B>();
    let Some(entry) = registry.iter().find(|e| e.gguf_names.contains(&arch.as_str())) else {
        return Err(match arch.as_str() {
            "" => LoadError::NoArchitecture { path: path.to_owned() },
            _ => LoadError::Unsupported {
                path: path.to_owned(),
                what: "GGUF architecture",
                name: arch,
                supported: architectures::<B>().join(", "),
            },
        });
    };
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let chat_template = ChatTemplate::from_gguf(&file, &tokenizer).map_err(|e| match e {
        TemplateError::File { .. } => e.to_string(),
        e => format!("{}: tokenizer.chat_template: {e}", path.display()),
    });
    let token_id = |key: &str| {
        file.get(&format!("tokenizer.ggml.{key}")).and_then(|v| v.as_u64()).and_then(|n| u32::try_from(n).ok())
    };
    let extra_eog: Vec<u32> = ["eot_token_id", "eom_token_id"].iter().filter_map(|k| token_id(k)).collect();
    (entry.check_gguf)(&file).map_err(|message| LoadError::Config { path: path.to_owned(), message })?;
    let weights = Weights::Gguf(file);
    let _progress = weights.show_progress(path);
    let model = (entry.from_gguf)(backend, weights).map_err(|e| match e {
        LoadStep::Config(message) => LoadError::Config { path: path.to_owned(), message },
        LoadStep::Weights(cause) => LoadError::Weights { path: path.to_owned(), cause },
    })?;
    finish(model, tokenizer, chat_template, &extra_eog)
}

/// Texts llama.cpp treats as end-of-generation when they are special tokens of the vocabulary.
const END_OF_TURN_TEXTS: [&str; 8] =
    ["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "<|end_of_text|>"];

fn finish<B: Backend>(
    model: Box<dyn CausalLm<B>>,
    tokenizer: Tokenizer,
    chat_template: Result<Option<ChatTemplate>, impl std::fmt::Display>,
    extra_eog: &[u32],
) -> Result<Loaded<B>, LoadError> {
    let (chat_template, chat_template_error) = match chat_template {
        Ok(t) => (t, None),
        Err(e) => (None, Some(e.to_string())),
    };
    check_vocab(&tokenizer, model.as_ref())?;
    let mut end_of_generation = model.info().eos_token_ids.clone();
    let named = END_OF_TURN_TEXTS.iter().filter_map(|t| tokenizer.special_id(t));
    for id in extra_eog.iter().copied().chain(named) {
        if !end_of_generation.contains(&id) && (id as usize) < model.info().vocab_size {
            end_of_generation.push(id);
        }
    }
    let bos_token_id = model.info().bos_token_id;
    let text = ModelText { tokenizer, chat_template, chat_template_error, end_of_generation, bos_token_id };
    Ok(Loaded { model, text })
}

fn check_vocab<B: Backend>(tokenizer: &Tokenizer, model: &dyn CausalLm<B>) -> Result<(), LoadError> {
    let n = model.info().vocab_size;
    if tokenizer.vocab_size() > n {
        return Err(LoadError::VocabMismatch { tokenizer: tokenizer.vocab_size(), model: n });
    }
    Ok(())
}
