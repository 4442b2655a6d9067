"""Train the small default model that ships inside the package (``src/pipeline/default_model``).

The model is a tiny Qwen3-MoE (``Qwen3MoeForCausalLM``) with its own byte-level BPE tokenizer
and a ChatML chat template with tool support. Everything it learns comes from text that every
CPython installation carries offline:

* ``pydoc_data.topics.topics`` -- the English help texts behind ``help("assert")`` and friends;
* the docstrings of the standard-library modules, their public classes, functions and methods.

Paragraphs of that text are wrapped in chat conversations (the user asks about a topic, the
assistant answers with the paragraph), rendered through the chat template the model ships with,
packed into fixed-length blocks and learned with plain next-token prediction.

The run is deterministic from ``--seed``: the corpus is collected in sorted order, every random
choice uses a seeded ``random.Random``, the model and the batch order come from seeded torch
generators, ``torch.use_deterministic_algorithms(True)`` is on, and the thread count is fixed.
The same Python, torch, tokenizers and transformers versions and the same ``--threads`` give
bit-identical weights. The step budget (``--steps``) sets the learning-rate schedule; an
optional wall-clock guard (``--minutes``) stops early, which the log then says (and which makes
the weights depend on the machine's speed, so the shipped model is trained without it).

Usage::

    python scripts/train_default_model.py --out src/pipeline/default_model
    python scripts/train_default_model.py --out /tmp/smoke --minutes 2
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import math
import os
import pkgutil
import random
import re
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added as whole tokens but not "special", as in Qwen's tokenizers: they survive decoding.
TEXT_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
               "<think>", "</think>"]
# Importing these has side effects (a browser, a poem, a GUI) or needs a platform we lack.
SKIP_MODULES = {"antigravity", "this", "idlelib", "turtledemo", "turtle", "tkinter", "test",
                "lib2to3", "ensurepip", "pydoc_data", "__main__", "msilib", "winreg",
                "winsound", "msvcrt", "nt"}
# Their submodules' docstrings are near-identical boilerplate (``encodings.cp1252`` and ~80
# more codec tables) that would dominate the answers about modules.
SKIP_SUBMODULES_OF = {"encodings"}
SYSTEM_PROMPT = "You are a helpful assistant."
HELP_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python_help",
        "description": "Look up a topic in the Python documentation.",
        "parameters": {
            "type": "object",
            "properties": {"topic": {"type": "string", "description": "The topic to look up."}},
            "required": ["topic"],
        },
    },
}

CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n\
{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TOPIC_QUESTIONS = ["What is {t}?", "Explain {t}.", "Tell me about {t}.", "Describe {t}.",
                   "How does {t} work?", "Can you explain {t}?", "What should I know about {t}?",
                   "Give me an overview of {t}.", "What do you know about {t}?"]
OBJECT_QUESTIONS = ["What does {t} do?", "What is {t}?", "Explain {t}.", "How do I use {t}?",
                    "Describe {t}.", "What is {t} for?"]
MODULE_QUESTIONS = ["What is the {t} module?", "Describe the {t} module.",
                    "What is the {t} module for?", "Tell me about the {t} module."]
FOLLOW_UPS = ["Tell me more.", "Go on.", "What else?", "Can you say more?", "Continue."]
ONE_SENTENCE = " Answer in one sentence."


@dataclass(frozen=True)
class Section:
    """A titled run of prose paragraphs; ``kind`` picks the question templates."""

    title: str
    paragraphs: tuple[str, ...]
    kind: str  # "topic", "object" or "module"


@dataclass
class TrainConfig:
    """Everything that decides the weights; recorded next to them."""

    seed: int = 1234
    vocab_size: int = 6144
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 8
    experts_per_token: int = 2
    moe_intermediate_size: int = 256
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 450
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    router_aux_loss_coef: float = 0.01
    threads: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------

def reflow(paragraph: str) -> str:
    """Join a paragraph's lines into one line with single spaces."""
    return " ".join(paragraph.split())


def is_prose(paragraph: str) -> bool:
    """True for a paragraph of running English text (not code, grammar, tables or doctests).

    An indented paragraph (a method's description under its signature) counts only if all its
    lines share one indentation and it reads as full sentences; nested indentation is code.
    """
    lines = paragraph.splitlines()
    if not lines or any(line.lstrip().startswith(">>>") for line in lines):
        return False
    indents = {len(line) - len(line.lstrip()) for line in lines}
    text = reflow(paragraph)
    if indents != {0} and (len(indents) > 1 or not text.endswith(".") or len(text.split()) < 6):
        return False
    if len(text) < 40 or "::=" in text or "->" in text or "@" in text or text.count("|") > 2:
        return False
    letters = sum(ch.isalpha() or ch == " " for ch in text)
    return letters / len(text) > 0.8 and text[-1] in ".:?!)\""


def prose_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a docstring or help text, each reflowed to one line.

    A trailing colon (which introduced a code block that is dropped) becomes a full stop.
    """
    blocks = re.split(r"\n\s*\n", inspect.cleandoc(text))
    return [re.sub(r":$", ".", reflow(block)) for block in blocks if is_prose(block)]


def split_topic(text: str) -> list[tuple[str, str]]:
    """Split a pydoc help text into (heading, body) pairs at its underlined headings."""
    lines = text.splitlines()
    sections: list[tuple[str, list[str]]] = [("", [])]
    for i, line in enumerate(lines):
        if i + 1 < len(lines) and re.fullmatch(r"([*=\-~^])\1{2,}", lines[i + 1].strip()) \
                and line.strip():
            sections.append((line.strip(), []))
        elif not re.fullmatch(r"([*=\-~^])\1{2,}", line.strip()):
            sections[-1][1].append(line)
    return [(title, "\n".join(body)) for title, body in sections if title]


def topic_sections() -> list[Section]:
    """Sections from ``pydoc_data.topics``, in sorted topic order."""
    from pydoc_data.topics import topics

    out: list[Section] = []
    for key in sorted(topics):
        for heading, body in split_topic(topics[key]):
            paragraphs = prose_paragraphs(body)
            if paragraphs:
                title = re.sub(r"^The ", "the ", heading.replace('"', ""))
                out.append(Section(title, tuple(paragraphs), "topic"))
    return out


def stdlib_module_names() -> list[str]:
    """Importable public stdlib modules and submodules, sorted; import output is swallowed."""
    names: list[str] = []
    roots = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SKIP_MODULES)
    for root in roots:
        if not quiet_import(root):
            continue
        names.append(root)
        path = getattr(sys.modules[root], "__path__", None)
        if path is None:
            continue
        for info in sorted(pkgutil.walk_packages(path, root + ".", onerror=lambda _: None),
                           key=lambda i: i.name):
            parts = info.name.split(".")[1:]
            if root not in SKIP_SUBMODULES_OF \
                    and not any(p.startswith("_") or p in ("test", "tests") for p in parts) \
                    and quiet_import(info.name):
                names.append(info.name)
    return names


def quiet_import(name: str) -> bool:
    """Import a module with stdout and warnings silenced; False if it cannot be imported."""
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001 -- any failure just drops the module from the corpus
        return False


def module_docs(name: str) -> Iterator[tuple[str, str, str]]:
    """(qualified name, kind, docstring) for a module and its public objects, sorted by name."""
    module = sys.modules[name]
    yield name, "module", module.__doc__ or ""
    for attr, value in sorted(vars(module).items()):
        if attr.startswith("_") or getattr(value, "__module__", None) != name:
            continue
        if not (inspect.isclass(value) or inspect.isroutine(value)):
            continue
        yield f"{name}.{attr}", "object", value.__doc__ or ""
        if inspect.isclass(value):
            for member, obj in sorted(vars(value).items()):
                if not member.startswith("_") and (callable(obj) or isinstance(obj, property)):
                    yield f"{name}.{attr}.{member}", "object", getattr(obj, "__doc__", None) or ""


def docstring_sections(modules: list[str]) -> list[Section]:
    """Sections from stdlib docstrings; a docstring seen before (inherited, aliased) is skipped."""
    seen: set[str] = set()
    out: list[Section] = []
    for name in modules:
        for qualname, kind, doc in module_docs(name):
            if not isinstance(doc, str) or doc in seen:
                continue
            seen.add(doc)
            paragraphs = prose_paragraphs(doc)
            if paragraphs:
                out.append(Section(qualname, tuple(paragraphs), kind))
    return out


def corpus_digest(sections: list[Section]) -> str:
    """sha256 of the collected corpus, so two machines can check they trained on the same text."""
    h = hashlib.sha256()
    for s in sections:
        h.update(json.dumps([s.title, s.kind, s.paragraphs]).encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Conversations
# ---------------------------------------------------------------------------------------------

Conversation = dict[str, Any]  # {"messages": [...], "tools": [...] | None}


def answer_chunks(paragraphs: tuple[str, ...], limit: int = 700) -> list[str]:
    """Group consecutive paragraphs into answers of at most ``limit`` characters (one at least)."""
    chunks: list[str] = []
    for p in paragraphs:
        if chunks and len(chunks[-1]) + len(p) + 2 <= limit:
            chunks[-1] += "\n\n" + p
        else:
            chunks.append(p)
    return chunks


def first_sentence(text: str) -> str:
    """The first sentence of the first paragraph of ``text``."""
    paragraph = text.split("\n\n")[0]
    match = re.search(r"(?<=[a-z0-9)\"])[.!?](\s|$)", paragraph)
    return paragraph[: match.end()].strip() if match else paragraph


def question(section: Section, rng: random.Random) -> str:
    """A user question about the section's title, in one of several phrasings."""
    templates = {"topic": TOPIC_QUESTIONS, "object": OBJECT_QUESTIONS,
                 "module": MODULE_QUESTIONS}[section.kind]
    return rng.choice(templates).format(t=section.title)


def chat_conversations(section: Section, rng: random.Random) -> list[Conversation]:
    """Conversations covering all of a section: a question, then up to two follow-ups each.

    About a quarter of the first questions ask for one sentence and get the first sentence.
    """
    chunks, ask, out = answer_chunks(section.paragraphs), question(section, rng), []
    if rng.random() < 0.25:
        out.append([{"role": "user", "content": ask + ONE_SENTENCE},
                    {"role": "assistant", "content": first_sentence(chunks[0])}])
    for start in range(0, len(chunks), 3):
        messages: list[dict[str, Any]] = []
        for i, chunk in enumerate(chunks[start: start + 3]):
            first = ask if start == 0 else f"Tell me more about {section.title}."
            messages.append({"role": "user", "content": first if i == 0 else rng.choice(FOLLOW_UPS)})
            messages.append({"role": "assistant", "content": chunk})
        out.append(messages)
    for messages in out:
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    return [{"messages": m, "tools": None} for m in out]


def tool_conversation(section: Section, rng: random.Random) -> Conversation:
    """A tool round trip: the assistant calls ``python_help``, reads the result, then answers."""
    call = {"type": "function",
            "function": {"name": "python_help", "arguments": {"topic": section.title}}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"Look up {section.title} in the Python documentation."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": section.paragraphs[0]},
        {"role": "assistant", "content": first_sentence(section.paragraphs[0])},
    ]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    return {"messages": messages, "tools": [HELP_TOOL]}


def conversations(sections: list[Section], seed: int) -> list[Conversation]:
    """The chat conversations of every section, plus a tool round trip for one in forty.

    The tool system block is long and always the same; more of it would crowd out the prose.
    """
    rng = random.Random(seed)
    out: list[Conversation] = []
    for section in sections:
        out.extend(chat_conversations(section, rng))
        if rng.random() < 1 / 40:
            out.append(tool_conversation(section, rng))
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def tokenizer_texts(convs: list[Conversation]) -> Iterator[str]:
    """The plain text the BPE merges are learned from: every message, plus the template prose."""
    yield CHAT_TEMPLATE
    for conv in convs:
        for message in conv["messages"]:
            yield message["role"] + "\n" + (message.get("content") or "")


def train_tokenizer(convs: list[Conversation], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` ids in all: specials first, text tokens last."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TEXT_TOKENS), min_frequency=2, show_progress=False,
        special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(tokenizer_texts(convs), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    return tok


def hf_tokenizer(tok: Tokenizer) -> Any:
    """Wrap the tokenizer for transformers, with the chat template and the special tokens."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        unk_token=None, bos_token=None, chat_template=CHAT_TEMPLATE, model_max_length=4096,
        clean_up_tokenization_spaces=False, split_special_tokens=False)


def encode_conversations(convs: list[Conversation], hf_tok: Any) -> list[list[int]]:
    """Render each conversation through the chat template and encode it, ending in endoftext."""
    texts = [hf_tok.apply_chat_template(c["messages"], tools=c["tools"], tokenize=False)
             for c in convs]
    eot = hf_tok.convert_tokens_to_ids("<|endoftext|>")
    encoded = hf_tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    return [e.ids + [eot] for e in encoded]


# ---------------------------------------------------------------------------------------------
# Model and training
# ---------------------------------------------------------------------------------------------

def build_model(cfg: TrainConfig, tokenizer: Any) -> Any:
    """A freshly initialised Qwen3MoeForCausalLM (fp32, tied embeddings) from the seed."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=2 * cfg.moe_intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.experts_per_token, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=4096, rope_theta=10000.0,
        tie_word_embeddings=True, router_aux_loss_coef=cfg.router_aux_loss_coef,
        bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    config._attn_implementation = "sdpa"
    torch.manual_seed(cfg.seed)
    return Qwen3MoeForCausalLM(config)


def pack(docs: list[list[int]], seq_len: int, seed: int) -> torch.Tensor:
    """Shuffle the documents with ``seed``, concatenate them and cut blocks of ``seq_len + 1``."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    stream = [t for i in order for t in docs[i]]
    n = (len(stream) - 1) // seq_len
    blocks = [stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)]
    return torch.tensor(blocks, dtype=torch.long)


def batches(docs: list[list[int]], cfg: TrainConfig) -> Iterator[torch.Tensor]:
    """Endless batches of blocks; each epoch re-shuffles documents with ``seed + epoch``."""
    epoch = 0
    while True:
        blocks = pack(docs, cfg.seq_len, cfg.seed + epoch)
        order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(cfg.seed + epoch))
        for i in range(0, len(order) - cfg.batch_size + 1, cfg.batch_size):
            yield blocks[order[i: i + cfg.batch_size]]
        epoch += 1


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak at ``cfg.steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: Any, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; norms, biases and the router are not decayed."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name or ".gate." in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def step_loss(model: Any, batch: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(total loss with the router balance term, plain next-token loss) for one batch."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    out = model(input_ids=inputs, output_router_logits=True)
    lm = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten())
    total = lm + model.config.router_aux_loss_coef * out.aux_loss
    return total, float(lm.detach())


@torch.no_grad()
def evaluate(model: Any, docs: list[list[int]], cfg: TrainConfig) -> float:
    """Mean next-token loss over the held-out documents, packed once in a fixed order."""
    model.eval()
    blocks = pack(docs, cfg.seq_len, seed=0)
    losses = [step_loss(model, blocks[i: i + cfg.batch_size])[1]
              for i in range(0, len(blocks), cfg.batch_size)]
    model.train()
    return sum(losses) / max(1, len(losses))


def train(model: Any, train_docs: list[list[int]], cfg: TrainConfig,
          minutes: float | None) -> dict[str, Any]:
    """Run the optimiser for ``cfg.steps`` steps or until ``minutes`` pass; return the log."""
    opt, data, log = make_optimizer(model, cfg), batches(train_docs, cfg), []
    start, window, step = time.monotonic(), [], 0
    model.train()
    for step in range(cfg.steps):
        if minutes is not None and time.monotonic() - start > minutes * 60:
            print(f"time budget of {minutes} min reached at step {step}", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        total, lm = step_loss(model, next(data))
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window.append(lm)
        if (step + 1) % 10 == 0 or step + 1 == cfg.steps:
            log.append(log_line(step + 1, window, opt, start, cfg))
            window = []
    else:
        step = cfg.steps
    return {"steps_done": step, "seconds": time.monotonic() - start, "log": log}


def log_line(step: int, window: list[float], opt: torch.optim.Optimizer, start: float,
             cfg: TrainConfig) -> dict[str, float]:
    """Print and return one progress record (mean loss over the last window of steps)."""
    elapsed = time.monotonic() - start
    loss = sum(window) / len(window)
    tok_s = step * cfg.batch_size * cfg.seq_len / elapsed
    print(f"step {step:5d}  loss {loss:.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
          f"{elapsed / 60:6.2f} min  {tok_s:7.0f} tok/s", flush=True)
    return {"step": step, "loss": round(loss, 4), "minutes": round(elapsed / 60, 3)}


# ---------------------------------------------------------------------------------------------
# Saving and sampling
# ---------------------------------------------------------------------------------------------

def save(model: Any, hf_tok: Any, out: Path) -> None:
    """Write the Hugging Face layout: bf16 safetensors, configs, tokenizer with chat template."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.config.use_cache = True
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    gen = GenerationConfig(
        eos_token_id=[hf_tok.convert_tokens_to_ids("<|im_end|>"),
                      hf_tok.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=hf_tok.convert_tokens_to_ids("<|endoftext|>"), do_sample=True,
        temperature=0.7, top_p=0.9, top_k=40, repetition_penalty=1.1, max_new_tokens=256)
    gen.save_pretrained(out)
    hf_tok.save_pretrained(out)
    inline_chat_template(out)
    add_portable_keys(out, model.config)
    for path in out.iterdir():
        path.chmod(0o644)  # save_pretrained writes the weights owner-only


def inline_chat_template(out: Path) -> None:
    """Keep the chat template in ``tokenizer_config.json`` only (one source of truth)."""
    config_path, jinja_path = out / "tokenizer_config.json", out / "chat_template.jinja"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    jinja_path.unlink(missing_ok=True)


def add_portable_keys(out: Path, config: Any) -> None:
    """Also write the key names older readers (transformers 4.x, most loaders) look for.

    transformers 5 writes ``num_local_experts``, ``rope_parameters`` and a ``TokenizersBackend``
    class; Qwen3-MoE checkpoints on the Hub say ``num_experts``, ``rope_theta`` and
    ``PreTrainedTokenizerFast``. Both spellings are written and agree.
    """
    model_path, tok_path = out / "config.json", out / "tokenizer_config.json"
    model_config = json.loads(model_path.read_text())
    model_config["num_experts"] = config.num_experts
    model_config["rope_theta"] = config.rope_parameters["rope_theta"]
    model_path.write_text(json.dumps(model_config, indent=2, sort_keys=True) + "\n")
    tok_config = json.loads(tok_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


SAMPLE_PROMPTS = ["Why is the sky usually blue? Answer in one sentence.",
                  "What is a list comprehension?", "What does the json module do?"]


@torch.no_grad()
def samples(out: Path, seed: int) -> list[dict[str, str]]:
    """Reload the saved folder with transformers and answer ``SAMPLE_PROMPTS``, greedy and sampled."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    results = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        for mode in ("greedy", "sampled"):
            torch.manual_seed(seed)
            gen = model.generate(ids, max_new_tokens=80, do_sample=mode == "sampled",
                                 repetition_penalty=1.1)
            text = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
            results.append({"prompt": prompt, "mode": mode, "reply": text})
            print(f"[{mode}] {prompt}\n  -> {text!r}", flush=True)
    return results


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; the defaults are the shipped model."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("src/pipeline/default_model"))
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--minutes", type=float, default=None,
                        help="optional wall-clock guard for the optimiser loop (default: none)")
    parser.add_argument("--threads", type=int, default=TrainConfig.threads)
    return parser.parse_args(argv)


def setup_determinism(cfg: TrainConfig) -> None:
    """Seed everything, fix the thread count and ask torch for deterministic kernels."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)


def prepare_data(cfg: TrainConfig) -> tuple[Any, list[list[int]], list[list[int]], dict[str, Any]]:
    """Collect the corpus, train the tokenizer, encode; every 50th conversation is held out."""
    sections = topic_sections() + docstring_sections(stdlib_module_names())
    convs = conversations(sections, cfg.seed)
    hf_tok = hf_tokenizer(train_tokenizer(convs, cfg.vocab_size))
    docs = encode_conversations(convs, hf_tok)
    train_docs = [d for i, d in enumerate(docs) if i % 50 != 49]
    held_out = [d for i, d in enumerate(docs) if i % 50 == 49]
    stats = {"sections": len(sections), "conversations": len(convs),
             "corpus_chars": sum(len(p) for s in sections for p in s.paragraphs),
             "corpus_sha256": corpus_digest(sections),
             "train_tokens": sum(map(len, train_docs)), "held_out_tokens": sum(map(len, held_out))}
    print(json.dumps(stats), flush=True)
    return hf_tok, train_docs, held_out, stats


def versions() -> dict[str, str]:
    """The library versions bit-identical weights depend on."""
    import tokenizers
    import transformers

    return {"python": sys.version.split()[0], "torch": torch.__version__,
            "tokenizers": tokenizers.__version__, "transformers": transformers.__version__}


def folder_report(out: Path) -> dict[str, int]:
    """Size in bytes of each file the run wrote."""
    return {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}


def main(argv: list[str] | None = None) -> None:
    """Collect, tokenize, train, save, sample, and write ``training_log.json``."""
    args = parse_args(argv)
    cfg = TrainConfig(seed=args.seed, steps=args.steps, threads=args.threads)
    setup_determinism(cfg)
    t0 = time.monotonic()
    hf_tok, train_docs, held_out, stats = prepare_data(cfg)
    model = build_model(cfg, hf_tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params:,}; data prepared in {time.monotonic() - t0:.1f} s", flush=True)
    run = train(model, train_docs, cfg, args.minutes)
    held_out_loss = evaluate(model, held_out, cfg)
    print(f"held-out loss {held_out_loss:.4f}", flush=True)
    save(model, hf_tok, args.out)
    record = {"config": asdict(cfg), "parameters": n_params, "data": stats,
              "held_out_loss": round(held_out_loss, 4), "total_minutes": None,
              "versions": versions(), **run}
    record["samples"] = samples(args.out, cfg.seed)
    record["total_minutes"] = round((time.monotonic() - t0) / 60, 2)
    (args.out / "training_log.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(folder_report(args.out)), flush=True)


if __name__ == "__main__":
    main()
