from typing import Iterator, Optional, Sequence, Union

__version__: str

Prompt = Union[str, Sequence[int]]

class ForgeError(RuntimeError): ...

class Completion:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    logprobs: Optional[list[float]]
    top_logprobs: Optional[list[list[tuple[int, float]]]]

class Stream(Iterator[str]):
    def __iter__(self) -> "Stream": ...
    def __next__(self) -> str: ...

class Model:
    architecture: str
    vocab_size: int
    context_length: int
    n_params: int
    eos_token_ids: list[int]
    backend: str
    path: str
    def __init__(
        self,
        path: str,
        *,
        backend: str = "cpu",
        threads: Optional[int] = None,
        dtype: Optional[str] = None,
        kv_dtype: str = "f32",
        batch_invariant: bool = True,
    ) -> None: ...
    def generate(self, prompt: Prompt, **sampling: object) -> str: ...
    def complete(self, prompt: Prompt, **sampling: object) -> Completion: ...
    def stream(self, prompt: Prompt, **sampling: object) -> Stream: ...
    def chat(self, messages: list[dict[str, str]], **sampling: object) -> str: ...
    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]: ...
    def detokenize(self, ids: Sequence[int]) -> str: ...
    def score(self, prompt: Prompt) -> list[float]: ...
    def loglikelihood(self, context: Prompt, continuation: Prompt) -> tuple[float, bool]: ...
