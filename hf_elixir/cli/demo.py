"""``hf-elixir demo``: fine-tune a pretrained GPT-2 with the Trainer on hf_elixir, end to end.

The demo is what a user of this package does: take a pretrained GPT-2, fine-tune it on text
of another style with ``examples/finetune_gpt2_trainer.py`` started by ``hf-elixir launch``
on every local device (2 processes on a CPU-only machine), and look at the held-out
perplexity and a sample before and after.

Where no model hub can be reached, the default pretrained model is a small GPT-2 the demo
pre-trains once on ``examples/data/tiny_corpus.txt`` and ``examples/data/coast_prose.txt``
(prose in the words of the fine-tuning text, not in its style), with a byte-level BPE
tokenizer trained on all the demo's text (as GPT-2's tokenizer covers the text it meets); both
are saved as ordinary ``from_pretrained`` folders in a cache and reused.
``--model_name_or_path gpt2`` fine-tunes the real checkpoint where the hub is reachable. The
fine-tuning text is a lighthouse logbook (``examples/data/logbook_*.txt``): the base knows its
words, and fine-tuning teaches it the logbook's style.

``--lora`` fine-tunes LoRA adapters (PEFT) over the frozen base instead of every weight: the
same Trainer script with ``--lora_r``, an adapter folder as the result, and a check that
``PeftModel.from_pretrained`` on the base reproduces the trained model. PEFT is an optional
dependency (``pip install -e .[peft]``).

``--qlora`` is LoRA over a base quantised to 4 bits on load (bitsandbytes nf4, the script's
``--load_in_4bit``): the base is a small Llama-style model pre-trained the same way, and the
adapter is reloaded onto a freshly quantised base. It needs ``pip install -e ".[qlora]"``
(bitsandbytes and PEFT); bitsandbytes runs 4-bit layers on a CPU too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from hf_elixir.cli.common import CLIError
from hf_elixir.hardware import HardwareProfile, cache_path
from hf_elixir.integrations.launch import LaunchError, default_config, launch, write_config
from hf_elixir.integrations.plugin import ElixirPlugin
from hf_elixir.measure import calibrate_machine

ROOT = Path(__file__).resolve().parents[2]  # hf_elixir/cli/demo.py -> the checkout
EXAMPLES = ROOT / "examples"
DATA = EXAMPLES / "data"
SCRIPT = EXAMPLES / "finetune_gpt2_trainer.py"
EOS = "<|endoftext|>"
PEFT_INSTALL = "pip install -e .[peft]"
QLORA_INSTALL = 'pip install -e ".[qlora]"'
# The base models' pre-training text: generic sentences, and prose in the logbook's words
# (make_coast_prose.py), so that the base knows the logbook's tokens but not its style.
PRETRAIN_FILES = ("tiny_corpus.txt", "coast_prose.txt")


@dataclass(frozen=True)
class LoraRecipe:
    """The demo's LoRA fine-tune: every linear layer of the blocks adapted (the QLoRA paper's
    finding: adapting all of them matters more than the rank), the output head and embeddings
    frozen. Adapters start at zero and have few weights, so they take a higher learning rate
    than full fine-tuning."""

    r: int = 8
    target_modules: str = "all-linear"
    learning_rate: float = 1e-2

    def args(self) -> list[str]:
        return ["--lora_r", str(self.r), "--lora_target_modules", self.target_modules]


LORA = LoraRecipe()


@dataclass(frozen=True)
class BaseRecipe:
    """How the stand-in for a hub model is made (a GPT-2, or for ``--qlora`` a Llama-style
    model: RMSNorm, rotary positions, a gated MLP of ``n_inner``, ``n_kv_head`` key/value
    heads); its hash, with the text, names the cache folder."""

    arch: str = "gpt2"
    vocab_size: int = 1024
    n_embd: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_positions: int = 128
    steps: int = 150
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 3e-3
    seed: int = 0
    n_inner: Optional[int] = None  # llama only
    n_kv_head: Optional[int] = None  # llama only

    def key(self, corpus: bytes) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode() + corpus
        return hashlib.sha256(blob).hexdigest()[:16]


FULL = BaseRecipe()
# --fast: half the layers and vocabulary; still pre-trained long enough to know the logbook's
# words (at 60 steps of width 64 it did not, and LoRA over it barely moved the perplexity)
FAST = BaseRecipe(vocab_size=512, n_layer=2)
LLAMA = replace(FULL, arch="llama", n_inner=384, n_kv_head=2)
LLAMA_FAST = replace(FAST, arch="llama", n_inner=384, n_kv_head=2)


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hf_elixir" / "demo"


# ---------------------------------------------------------------------- the base model
def ensure_base_model(cache: Path, recipe: BaseRecipe, log=print) -> Path:
    """The cached pre-trained stand-in for ``gpt2`` (or, for ``recipe.arch == "llama"``, for
    a small Llama), made once (tokenizer and weights)."""
    text = "\n".join((DATA / name).read_text() for name in PRETRAIN_FILES)
    # GPT-2's tokenizer has seen text of every kind; this one sees the fine-tuning text too
    vocabulary_text = text + (DATA / "logbook_train.txt").read_text()
    name = "GPT-2" if recipe.arch == "gpt2" else "Llama-style model"
    folder = cache / f"{recipe.arch}-small-demo-{recipe.key(vocabulary_text.encode())}"
    if (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file():
        log(f"pretrained model: {folder} (cached)")
        return folder
    log(f"No model hub here: pre-training a small {name} once on examples/data/"
        f"{{{','.join(PRETRAIN_FILES)}}} ({recipe.n_layer} layers, width {recipe.n_embd}, {recipe.steps} steps) "
        f"and a byte-level BPE tokenizer; cached in {folder}", flush=True)
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = train_tokenizer(vocabulary_text, recipe.vocab_size)
    tokenizer.save_pretrained(tmp)
    model = pretrain(text, tokenizer, recipe, log)
    model.save_pretrained(tmp)
    if folder.exists():  # another demo finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.rename(tmp, folder)
    return folder


def train_tokenizer(text: str, vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2's scheme) trained on ``text``."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(text.splitlines(keepends=True), vocab_size=vocab_size, min_frequency=2,
                            special_tokens=[EOS], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token=EOS, eos_token=EOS,
                                   unk_token=EOS, pad_token=EOS)


def base_config(recipe: BaseRecipe, vocab_size: int, eos_id: int):
    """The model config of ``recipe``: GPT-2's, or a Llama's (tied embeddings, as small
    Llamas have them)."""
    from transformers import GPT2Config, LlamaConfig

    if recipe.arch == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_positions=recipe.n_positions, n_embd=recipe.n_embd,
                          n_layer=recipe.n_layer, n_head=recipe.n_head, bos_token_id=eos_id, eos_token_id=eos_id,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if recipe.arch == "llama":
        return LlamaConfig(vocab_size=vocab_size, hidden_size=recipe.n_embd, intermediate_size=recipe.n_inner,
                           num_hidden_layers=recipe.n_layer, num_attention_heads=recipe.n_head,
                           num_key_value_heads=recipe.n_kv_head, max_position_embeddings=recipe.n_positions,
                           tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    raise ValueError(f"unknown demo base architecture {recipe.arch!r}")


def pretrain(text: str, tokenizer, recipe: BaseRecipe, log=print):
    """Plain PyTorch pre-training on random windows of the corpus (one process)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(recipe.seed)
    ids = torch.tensor(tokenizer(text).input_ids)
    model = AutoModelForCausalLM.from_config(base_config(recipe, len(tokenizer), tokenizer.eos_token_id))
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.01, fused=True)
    warmup = max(1, recipe.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.05, (recipe.steps - s) / (recipe.steps - warmup))))
    gen = torch.Generator().manual_seed(recipe.seed)
    start = time.perf_counter()
    model.train()
    for step in range(1, recipe.steps + 1):
        starts = torch.randint(0, len(ids) - recipe.seq_len - 1, (recipe.batch_size,), generator=gen)
        batch = torch.stack([ids[s : s + recipe.seq_len] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == recipe.steps:
            log(f"  pre-training step {step}/{recipe.steps}  loss {loss.item():.3f}  "
                f"({time.perf_counter() - start:.0f}s)", flush=True)
    return model.eval()


# ---------------------------------------------------------------------- the fine-tune
def finetune_args(model: str, output: Path, fast: bool, port: int, lora: Optional[LoraRecipe] = None,
                  load_in_4bit: bool = False) -> list[str]:
    """The launcher and Trainer arguments of the fine-tune (of LoRA adapters if ``lora``, over
    a base quantised to 4 bits on load if ``load_in_4bit``)."""
    steps = 30 if fast else 100
    args = [
        "--main_process_port", str(port),
        str(SCRIPT),
        "--model_name_or_path", str(model),
        "--train_file", str(DATA / "logbook_train.txt"),
        "--validation_file", str(DATA / "logbook_valid.txt"),
        "--block_size", "64",
        "--output_dir", str(output),
        "--save_strategy", "no",
        "--eval_strategy", "no",
        "--max_steps", str(steps),
        "--per_device_train_batch_size", "8",
        "--per_device_eval_batch_size", "8",
        "--gradient_accumulation_steps", "2",
        "--learning_rate", "3e-3",
        "--warmup_steps", str(steps // 10),
        "--weight_decay", "0.01",
        "--max_grad_norm", "1.0",
        "--logging_steps", "5",
        "--report_to", "none",
        "--seed", "0",
        "--prompt", "Day 400.",
        "--dataloader_num_workers", "0",
    ]
    if lora is not None:
        args[args.index("--learning_rate") + 1] = str(lora.learning_rate)
        args += lora.args()
    if load_in_4bit:
        args += ["--load_in_4bit", "true"]
    return args


def require_peft() -> None:
    """Fail before any work when ``--lora`` cannot run: PEFT is an optional dependency."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise CLIError(f"--lora fine-tunes with PEFT, which is not installed here: {PEFT_INSTALL} "
                       "(or pip install peft), then run the demo again") from None


def require_qlora() -> None:
    """Fail before any work when ``--qlora`` cannot run: it needs bitsandbytes and PEFT (looked
    up, not imported: the fine-tuning processes import them)."""
    missing = [module for module in ("bitsandbytes", "peft") if importlib.util.find_spec(module) is None]
    if missing:
        raise CLIError(f"--qlora quantises the base with bitsandbytes and fine-tunes with PEFT; "
                       f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed here: "
                       f"{QLORA_INSTALL}, then run the demo again")


def ensure_calibration(quick: bool = False, log=print) -> None:
    """Calibrate this machine once, so the plan's predicted times are this machine's; again
    when the cached calibration timed another revision of the runtime's routines, or was
    quick and a full one is wanted. ``quick`` (``--fast``) measures at small sizes: seconds
    rather than the minute or more a full calibration takes on a small CPU machine, which
    would be most of a fast demo's time."""
    cached = HardwareProfile.cached(warn_stale=False)
    if cached is not None and cached.is_current() and (quick or not cached.calibration_quick):
        return
    # full: 67 s on the 2-core test VM (two one-thread ranks re-measure compute side by
    # side); quick: 15 s
    if cached is None:
        why = "once"
    elif not cached.is_current():
        why = "again (the cached calibration timed another hf_elixir's routines)"
    else:
        why = "again at full size (the cached calibration was a quick one)"
    how = "quickly" if quick else "(a minute or more on a small CPU machine)"
    log(f"calibrating this machine {why} for the planner {how}; cached in {cache_path()}", flush=True)
    started = time.perf_counter()
    calibrate_machine(quick=quick)
    log(f"calibrated in {time.perf_counter() - started:.0f} s", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def register_demo(sub) -> None:
    p = sub.add_parser("demo", help="fine-tune a pretrained GPT-2 with the Trainer on hf_elixir (a few minutes)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model_name_or_path", default=None,
                   help="hub id or folder of a pretrained causal LM (default: the demo's own small GPT-2, "
                        "or with --qlora its own small Llama-style model)")
    p.add_argument("--output", default="out/demo",
                   help="where the fine-tuned model (model/; with --lora or --qlora the adapter, adapter/) "
                        "and config go")
    p.add_argument("--cache-dir", default=None, help=f"where the demo's base models are cached (default {default_cache()})")
    p.add_argument("--num_processes", type=int, default=None, help="processes (default: GPUs, or 2 on a CPU)")
    p.add_argument("--fast", action="store_true", help="a smaller base model, fewer steps and a quick calibration (for CI)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--lora", action="store_true",
                      help=f"fine-tune LoRA adapters over the frozen base instead of every weight (PEFT: {PEFT_INSTALL})")
    kind.add_argument("--qlora", action="store_true",
                      help="fine-tune LoRA adapters over a small Llama-style base quantised to 4 bits on load "
                           f"(bitsandbytes nf4 and PEFT: {QLORA_INSTALL})")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    import torch

    if not SCRIPT.is_file():
        raise CLIError(f"the demo runs {SCRIPT}, which is missing: run it from a source checkout of hf_elixir")
    qlora = bool(getattr(args, "qlora", False))
    lora = LORA if args.lora or qlora else None
    if qlora:
        require_qlora()
    elif lora is not None:
        require_peft()
    output = Path(args.output).absolute()
    result = output / ("adapter" if lora else "model")
    if result.exists():
        shutil.rmtree(result)
    output.mkdir(parents=True, exist_ok=True)
    model: Optional[str] = args.model_name_or_path
    if model is None:
        if qlora:
            recipe = LLAMA_FAST if args.fast else LLAMA
        else:
            recipe = FAST if args.fast else FULL
        model = str(ensure_base_model(Path(args.cache_dir) if args.cache_dir else default_cache(), recipe))
    ensure_calibration(quick=args.fast)
    procs = args.num_processes or max(torch.cuda.device_count(), 2 if not torch.cuda.is_available() else 1)
    config = write_config(output / "accelerate_elixir.yaml",
                          default_config(procs, "bf16" if torch.cuda.is_available() else "no"),
                          ElixirPlugin(plan="auto", offload="auto", activation_checkpointing="auto"))
    what = f"LoRA adapters (r {lora.r}, {lora.target_modules}) of {model}" if lora else model
    if qlora:
        what += " quantised to 4 bits on load (nf4)"
    print(f"fine-tuning {what} on the lighthouse logbook with the Trainer on {procs} process(es):\n"
          f"  hf-elixir launch --config_file {config} {SCRIPT.relative_to(ROOT)} ...", flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        launch(config, finetune_args(model, result, args.fast, free_port(), lora, load_in_4bit=qlora))
    except LaunchError as e:
        raise CLIError(str(e)) from None
    if qlora:
        print(f"done: the LoRA adapter is in {result}; load it onto the base quantised the same way with\n"
              f"  PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({model!r}, quantization_config="
              f"BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\")), {str(result)!r})")
    elif lora:
        print(f"done: the LoRA adapter is in {result}; load it with\n"
              f"  PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({model!r}), {str(result)!r})")
    else:
        print(f"done: the fine-tuned model is in {result}")
    return 0
