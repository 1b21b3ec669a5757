"""Build a Hugging Face fast tokenizer offline from a tiktoken encoding (cl100k_base by default).

The tiny default model needs a *real* tokenizer without a model hub. tiktoken's encodings ship
inside litellm (``TIKTOKEN_CACHE_DIR``), so we turn one into a ``tokenizers`` byte-level BPE:

- vocab: every mergeable token's bytes, spelled in GPT-2's byte-to-unicode alphabet, at its rank;
- merges: for each token, every split ``(left, right)`` whose halves are both tokens, ordered by
  the rank of the merged token. tiktoken merges the adjacent pair whose *result* has the lowest
  rank, so ranking merges by their result reproduces its choices;
- ``ignore_merges=True``: tiktoken returns a pre-token that is itself in the vocab as one token
  without merging, and so must we;
- the encoding's own split regex, with one fix: oniguruma (used by ``tokenizers``) reads
  ``{1,3}+`` as "one or more runs of 1-3" rather than a possessive ``{1,3}``, which would glue long
  digit runs into one pre-token. Possessive and greedy are equivalent for that lone alternative.

Ids are kept exactly: mergeable ranks first, then the encoding's special tokens at their ids,
``<|im_start|>``/``<|im_end|>`` for the chat template, and ``<|reserved_N|>`` fillers so the vocab
is contiguous up to ``vocab_size`` (a multiple of 128 for friendly matmul shapes).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from engine.models.chat_template import IM_END, IM_START, chatml_template

if TYPE_CHECKING:  # tiktoken loads inside build_tokenizer only
    from tiktoken import Encoding

# cl100k_base leaves 100261..100275 unused; GPT-4's chat format put ChatML's markers here.
CHAT_SPECIAL_IDS = {IM_START: 100264, IM_END: 100265}
# ChatML with OpenAI-style tools (engine/models/chat_template.py); the tiny model has no default
# system prompt.
CHAT_TEMPLATE = chatml_template()


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map used by byte-level BPE."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _spell(token: bytes) -> str:
    alphabet = _byte_alphabet()
    return "".join(alphabet[b] for b in token)


def onig_compatible_pattern(pattern: str) -> str:
    """Rewrite possessive interval quantifiers (``{m,n}+``) that oniguruma misreads."""
    return re.sub(r"(\{\d+(?:,\d*)?\})\+", r"\1", pattern)


def special_tokens_for(encoding: Encoding) -> dict[str, int]:
    """The encoding's special tokens plus the ChatML markers (name -> id)."""
    specials = dict(encoding._special_tokens)
    for name, idx in CHAT_SPECIAL_IDS.items():
        clash = [n for n, i in specials.items() if i == idx and n != name]
        if clash:
            raise ValueError(f"id {idx} for {name} is taken by {clash[0]} in {encoding.name}")
        specials[name] = idx
    return specials


def _default_tiktoken_cache() -> None:
    """Point tiktoken at the encodings bundled with litellm unless the user chose a cache.

    Without a local file tiktoken would try to download the encoding; we never touch the network.
    litellm is located, not imported (importing it is slow and reads its price map).
    """
    if os.environ.get("TIKTOKEN_CACHE_DIR"):
        return
    spec = importlib.util.find_spec("litellm")
    if spec and spec.submodule_search_locations:
        bundled = Path(next(iter(spec.submodule_search_locations))) / "litellm_core_utils" / "tokenizers"
        if bundled.is_dir():
            os.environ["TIKTOKEN_CACHE_DIR"] = str(bundled)


# Where tiktoken downloads each encoding from; its local cache names the file sha1(url).
ENCODING_URLS = {
    "cl100k_base": "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
    "o200k_base": "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
    "p50k_base": "https://openaipublic.blob.core.windows.net/encodings/p50k_base.tiktoken",
}


def _require_local_encoding(encoding_name: str) -> None:
    """Fail with instructions instead of letting tiktoken try (and fail) to download the file."""
    url = ENCODING_URLS.get(encoding_name)
    if url is None:
        raise ValueError(f"unknown encoding {encoding_name!r}; known: {', '.join(ENCODING_URLS)}")
    cache_dir = (
        os.environ.get("TIKTOKEN_CACHE_DIR")
        or os.environ.get("DATA_GYM_CACHE_DIR")
        or os.path.join(tempfile.gettempdir(), "data-gym-cache")
    )
    if not (Path(cache_dir) / hashlib.sha1(url.encode()).hexdigest()).is_file():
        raise ValueError(
            f"tiktoken's {encoding_name} file is not in {cache_dir}; set TIKTOKEN_CACHE_DIR to a folder "
            "holding it (litellm ships one in litellm/litellm_core_utils/tokenizers)"
        )


def build_tokenizer(encoding_name: str = "cl100k_base", vocab_size: int = 100352) -> PreTrainedTokenizerFast:
    """A fast tokenizer whose ids equal ``tiktoken.get_encoding(encoding_name)``'s on any text.

    Raises ValueError if ``vocab_size`` cannot hold the encoding's tokens.
    """
    _default_tiktoken_cache()
    _require_local_encoding(encoding_name)
    import tiktoken  # imported here: only the tiny-model builder needs it

    encoding = tiktoken.get_encoding(encoding_name)
    ranks: dict[bytes, int] = encoding._mergeable_ranks
    specials = special_tokens_for(encoding)
    top = max([*ranks.values(), *specials.values()])
    if vocab_size <= top:
        raise ValueError(f"vocab_size {vocab_size} is too small for {encoding_name} (max id {top})")

    vocab = {_spell(token): rank for token, rank in ranks.items()}
    candidates: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                candidates.append((rank, ranks[left], ranks[right], left, right))
    candidates.sort()  # by merged-token rank first: tiktoken's merge priority
    merges = [(_spell(left), _spell(right)) for _, _, _, left, right in candidates]

    names = {idx: name for name, idx in specials.items()}
    for idx in range(len(ranks), vocab_size):
        names.setdefault(idx, f"<|reserved_{idx}|>")
    for idx, name in names.items():
        vocab[name] = idx

    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(onig_compatible_pattern(encoding._pat_str)), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(names[i], special=True, normalized=False) for i in sorted(names)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token="<|endoftext|>",
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
