"""Hugging Face `transformers` models and tokenizers, for the tasks that accept one (`model.hf`).

`model.hf` names the model three ways: a hub id (`from_pretrained`, where the network allows), a local directory
that `save_pretrained` wrote (its weights, refused without them, and beside them its tokenizer), or a local
`config.json` (random initialisation, `from_config`). The task picks the auto class (`model.hf_class` overrides it).
Built under `with torch.device("meta")` (`harness plan`, the FLOPs count) the model comes from its config alone: no
weights are read. Under ZeRO-3 the engine's builder builds it inside DeepSpeed's partitioned construction (`harness.distributed.zero3`), as
transformers' own DeepSpeed integration does; pretrained weights in local safetensors files are then read by each
rank for its own share (the loader that module sets in `PARTITIONED_LOADER`), anything else by `from_pretrained`
(rank 0 reads them all and scatters). Nothing distributed is imported here.

`transformers` is the optional extra `[hf]`; without it a run naming `model.hf` stops before launch.
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import json
import os
import re
import sys
from pathlib import Path

import torch
from torch import nn

from ..config.run import ConfigError, RunConfig, closest, one_line

EXTRA = 'pip install -e ".[hf]"'
WEIGHTS = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)")  # save_pretrained's, whole or sharded
# Set by `harness.distributed.zero3.zero_init` while a model is built partitioned over the ZeRO-3 ranks: the loader that has
# each rank read its own share of pretrained weights, `(cls, config, source) -> (model or None, how or why not)`.
PARTITIONED_LOADER: contextvars.ContextVar = contextvars.ContextVar("partitioned_loader", default=None)


def transformers_module(what: str):
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"{what} needs the transformers package: {EXTRA}") from None
    return transformers


def _config_source(ref: str) -> tuple[str, bool]:
    """(what AutoConfig reads, whether the weights come with it): a config.json alone has none."""
    path = Path(ref).expanduser()
    if path.suffix == ".json":
        if not path.is_file():
            raise ConfigError(f"model.hf = {ref!r}: no such file")
        return str(path), False
    if path.is_file():
        raise ConfigError(f"model.hf = {ref!r} is a file; name a model directory (save_pretrained's) or a config.json")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(f"model.hf = {ref!r}: no config.json in that directory (save_pretrained writes one)")
    if path.is_dir():
        return str(path), True
    if ref.startswith((".", "/", "~")) or len(path.parts) > 2:  # a hub id is NAME or OWNER/NAME
        raise ConfigError(f"model.hf = {ref!r}: no such directory (a hub id is NAME or OWNER/NAME){_near(path)}")
    return hub_source(ref), True


@functools.cache
def hub_source(ref: str, named: str = "model.hf") -> str:
    """What `from_pretrained` should read for the hub id `ref`: the id itself where the Hub answers, else its snapshot
    in the Hugging Face cache, a local directory (said once). A compute node with no way out is common; there, for
    every file a snapshot lacks (a tokenizer's optional files, which a download of the model's own files never
    fetched), transformers asked the Hub five times, with back-off: 2 min 23 s to load a cached tokenizer. An id
    not cached is refused at once (it took 27 s of retries to say so), under HF_HUB_OFFLINE=1 too (transformers'
    paragraph named no cache), with a did-you-mean among the ids cached; there a cached id is left to
    `from_pretrained`, which reads the cache alone."""
    from huggingface_hub import constants, snapshot_download

    try:
        cached = snapshot_download(ref, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached, or no id the cache can hold
        cached = None
    if constants.HF_HUB_OFFLINE and cached is not None:
        return ref
    why = "HF_HUB_OFFLINE=1" if constants.HF_HUB_OFFLINE else _hub_unreachable(constants.ENDPOINT)
    if why is None:
        return ref
    where = why if constants.HF_HUB_OFFLINE else \
        f"the Hugging Face Hub ({constants.ENDPOINT}) does not answer from here ({why})"
    if cached is None:
        ids = [d.name.removeprefix("models--").replace("--", "/")
               for d in Path(constants.HF_HUB_CACHE).glob("models--*")]
        near = f" (did you mean {near!r}?)" if (near := closest(ref, ids)) else ""
        raise ConfigError(f"{named} = {ref!r}: {where}, and its cache here ({constants.HF_HUB_CACHE}) does not "
                          f"hold it{near}; download it where the network allows (hf download {ref}) into the cache "
                          f"this machine reads, or name a local directory{_no_folder(ref)}")
    # once: by `harness launch`'s check or one process, not again by its rank 0 (distributed.world.under_launcher)
    if os.environ.get("RANK", "0") == "0" and not os.environ.get("HARNESS_STATUS_FILE"):
        print(f"note: {where}: {named} = {ref!r} is read from its snapshot in the cache, {cached} (HF_HUB_OFFLINE=1 "
              f"says so at once)", file=sys.stderr)
    return cached


@functools.cache
def _hub_unreachable(endpoint: str) -> str | None:
    """Why the Hub does not answer (one request, through huggingface_hub's own session: its proxies), or None."""
    from huggingface_hub.utils import get_session

    try:
        get_session().head(endpoint, timeout=HUB_TIMEOUT_S)  # any answer, an error status too, is an answer
    except Exception as e:  # noqa: BLE001 - refused, unresolved, timed out, a proxy's failure: no Hub from here
        return one_line(e, 100) or type(e).__name__
    return None


HUB_TIMEOUT_S = 5.0


def _no_folder(ref: str) -> str:
    """For a hub id OWNER/NAME not found where a folder OWNER is here (a model downloaded beside it, or a typo of a
    local folder): that there is no such folder either, with a did-you-mean; "" otherwise."""
    folder = Path(ref)
    if folder.exists() or not folder.parent.is_dir() or str(folder.parent) == ".":
        return ""
    return f"; no folder {ref} here either{_near(folder)}"


def _near(path: Path) -> str:
    """A did-you-mean for a local folder that is not there, among its would-be siblings."""
    names = [p.name for p in path.parent.iterdir()] if path.parent.is_dir() else []
    return f"; did you mean {str(path.parent / near)!r}?" if (near := closest(path.name, names)) else ""


def check(cfg: RunConfig, auto_class: str, positions: int | None = None) -> None:
    """Before launch: the package, the source, the auto class and the config, read once (no weights), the model
    class it maps to, and the tokenizer's size. `positions`: the longest sample's (data.seq_len where the task adds
    no token of its own)."""
    transformers = transformers_module(f"model.hf = {cfg.model.hf!r}")
    cls_name = cfg.model.hf_class or auto_class
    named = getattr(transformers, cls_name, None)
    is_model = isinstance(named, type) and issubclass(named, transformers.PreTrainedModel)
    if not (hasattr(named, "_model_mapping") or is_model):
        raise ConfigError(f"model.hf_class = {cls_name!r} is no transformers auto class (e.g. {auto_class}) or model "
                          f"class")
    config = load_config(cfg)
    source, has_weights = _config_source(cfg.model.hf)
    _check_config(cfg, named, config, source)
    if not cfg.model.hf_tokenizer and has_weights:
        raise ConfigError(f"model.hf_tokenizer = false with model.hf = {cfg.model.hf!r}: pretrained weights know only "
                          f"their own tokenizer's ids; name a config.json to train from scratch on the task's tokenizer")
    local = has_weights and Path(source).is_dir()  # weights on this machine: their files are checked here
    if local:
        _check_files(cfg, Path(source))
    cls = model_class(cfg, auto_class, config)
    if cls is not None:
        _check_kind(cfg, auto_class, cls, config)
        _check_model(cfg, cls, config, positions or cfg.data.seq_len)
        if local:
            _check_weights(cfg, cls, config, weight_files(source))
    vocab = getattr(config, "vocab_size", None) or 0
    tok = tokenizer(cfg) if own_tokenizer(cfg) and vocab else None
    # the ids the task's rows can take: the base vocabulary and EOS (which joins them); a pad token added on top of
    # an unresized model (e.g. 32001 for 32000) never appears in its batches
    tokens = max(tok.vocab_size, (tok.eos_token_id or 0) + 1) if tok is not None else 0
    if tokens > vocab:  # ids past the embedding table: an IndexError in torch.embedding on every rank
        raise ConfigError(f"model.hf = {cfg.model.hf!r}: its tokenizer has {tokens} tokens and the model "
                          f"vocab_size = {vocab} in its config.json; use the model's own tokenizer, or resize its "
                          f"embeddings (resize_token_embeddings) and save it again")


def _check_config(cfg: RunConfig, cls, config, source: str) -> None:
    """What the config.json says that the model would fail on or pass over: code of its own beside it (auto_map)
    without model.trust_remote_code, a model class `cls` (model.hf_class) for other configs, a pad id past the
    embedding table."""
    cls_name = cls.__name__
    own = (getattr(config, "auto_map", None) or {}).get(cls_name)
    folder = Path(source) if Path(source).is_dir() else Path(source).parent
    module = own.split("--")[-1].rsplit(".", 1)[0] if isinstance(own, str) else ""
    if module and (folder / f"{module}.py").is_file() and not cfg.model.trust_remote_code:
        # (a library model_type loads without it, passing over that code; an export keeps auto_map, not the code)
        raise ConfigError(f"model.hf = {cfg.model.hf!r}: its config names code of its own for {cls_name} ({own}, in "
                          f"{module}.py beside it), which runs when the model loads; set model.trust_remote_code = "
                          f"true only if you trust its source (without it transformers trains its own "
                          f"{config.model_type!r} class instead)")
    made = getattr(cls, "config_class", None)  # (None: a base class, PreTrainedModel itself)
    if not hasattr(cls, "_model_mapping") and not (isinstance(made, type) and isinstance(config, made)):
        raise ConfigError(f"model.hf_class = {cls_name!r} builds {getattr(made, '__name__', 'no')} models; model.hf "
                          f"= {cfg.model.hf!r} is a {config.model_type!r} model ({type(config).__name__})")
    # (with model.hf_tokenizer = false the task sets the vocabulary and its ids itself)
    vocab, pad = getattr(config, "vocab_size", None) or 0, getattr(config, "pad_token_id", None)
    if own_tokenizer(cfg) and vocab and isinstance(pad, int) and pad >= vocab:  # the embedding's padding_idx
        raise ConfigError(f"model.hf = {cfg.model.hf!r}: its config.json gives pad_token_id = {pad}, past "
                          f"vocab_size = {vocab}, the size of the embedding table it indexes; change them together")


def _check_files(cfg: RunConfig, source: Path) -> None:
    """A local checkpoint holds what from_pretrained reads: weights, the index of its shards and every shard."""
    held = sorted(p.name for p in source.iterdir() if WEIGHTS.fullmatch(p.name))
    if not held:
        raise ConfigError(f"model.hf = {cfg.model.hf!r}: the directory holds no weights (model*.safetensors, "
                          f"pytorch_model*.bin); to start from random initialisation name its config.json: "
                          f"model.hf = {str(source / 'config.json')!r}")
    index = f"{LOADED[held[0].endswith('.bin')]}.index.json"
    if not set(held) & set(LOADED) and not any((source / f"{name}.index.json").is_file() for name in LOADED):
        raise ConfigError(f"model.hf = {cfg.model.hf!r}: holds the shards {held[0]}, ... but not the index that "
                          f"names them ({index}), which from_pretrained reads; copy or download the checkpoint whole")
    missing = [name for name in _shards(source) if not (source / name).is_file()]
    if missing:
        raise ConfigError(f"model.hf = {cfg.model.hf!r}: {len(missing)} of the shards its {INDEX} names are missing "
                          f"(e.g. {missing[0]}); copy or download the checkpoint whole")


def model_class(cfg: RunConfig, auto_class: str, config):
    """The class the auto class builds for `config` (model.hf_class itself where it names no auto class); None where
    the config's own code names it (auto_map), which is not imported to find out, or where the task's own auto class
    has none (the task's checks say what the model lacks for it)."""
    transformers = transformers_module(f"model.hf = {cfg.model.hf!r}")
    name = cfg.model.hf_class or auto_class
    auto = getattr(transformers, name)
    if not hasattr(auto, "_model_mapping"):  # a model class named itself
        return auto
    if name in (getattr(config, "auto_map", None) or {}):
        return None
    try:
        return auto._model_mapping[type(config)]
    except KeyError:  # transformers' own ValueError lists every model type it knows: a screen long
        if not cfg.model.hf_class:
            return None
        raise ConfigError(f"model.hf = {cfg.model.hf!r} is a {config.model_type!r} model ({type(config).__name__}), "
                          f"for which model.hf_class = {name!r} has no class") from None


def _check_kind(cfg: RunConfig, auto_class: str, cls, config) -> None:
    """model.hf_class gives a model of the kind the task trains: the class its own auto class builds for this config,
    or one derived from it (a classifier's head for the lm had trained to step 1, then stopped in its loss with a
    traceback; a headless model, on its outputs)."""
    if not cfg.model.hf_class:
        return
    auto = getattr(transformers_module(f"model.hf = {cfg.model.hf!r}"), auto_class)
    try:
        expected = auto._model_mapping[type(config)]
    except KeyError:  # a config the task's auto class has no class for: the task's own checks say what it lacks
        return
    if not (isinstance(cls, type) and issubclass(cls, expected)):
        raise ConfigError(f"model.hf_class = {cfg.model.hf_class!r} gives {cls.__name__}, and the {cfg.run.task} task "
                          f"trains what {auto_class} gives for this config ({expected.__name__}): its outputs are "
                          f"not what the task's loss reads; drop model.hf_class, or name a class of that kind")


def _check_model(cfg: RunConfig, cls, config, positions: int) -> None:
    """What the model class makes of the run: causal attention where the task predicts the next token, and a position
    for each of a sample's `positions` tokens."""
    try:  # transformers 5.24: 17 causal-LM classes (BertLMHeadModel, RobertaForCausalLM, ...) test is_decoder and,
        source = inspect.getsource(cls.__init__)  # false, only warn; those that set it (BartForCausalLM) do not
    except (OSError, TypeError):
        source = ""
    if re.search(r"(if not|assert) config\.is_decoder\b", source) and not getattr(config, "is_decoder", False):
        raise ConfigError(f"model.hf = {cfg.model.hf!r}: {cls.__name__} attends to every position unless its config "
                          f"says is_decoder = true; set it in config.json to train it as a causal language model")
    limit, pad = getattr(config, "max_position_embeddings", None), getattr(config, "pad_token_id", None)
    if isinstance(limit, int) and positions > limit - (pad + 1 if isinstance(pad, int) else 0):
        with torch.device("meta"):  # its modules, with no memory: a table of positions is an nn.Embedding of them
            model = cls(config)
        tables = [(n, m) for n, m in model.named_modules()
                  if isinstance(m, nn.Embedding) and re.search(r"pos|wpe", n.rsplit(".", 1)[-1])]
        if not tables:  # rotary positions (Llama) are computed for any length: the figure is not a hard limit there
            return
        name, table = tables[0]
        offset = 0 if table.padding_idx is None else table.padding_idx + 1  # RoBERTa, ESM: from padding_idx + 1
        room, besides = limit - offset, positions - cfg.data.seq_len
        if positions > room:
            key = type(config).attribute_map.get("max_position_embeddings", "max_position_embeddings")
            counted = f", counted from padding_idx + 1 = {offset}" if offset else ""
            took = f" and the task's {besides} token(s) around it take {positions}" if besides else \
                f" takes {positions}"
            raise ConfigError(f"data.seq_len = {cfg.data.seq_len}{took} positions; model.hf = {cfg.model.hf!r} has "
                              f"{room}: "
                              f"{key} = {limit} in its config.json (a table of absolute positions, {name}{counted}); "
                              f"set data.seq_len <= {room - besides}")


def _check_weights(cfg: RunConfig, cls, config, files: list[Path]) -> None:
    """The checkpoint's tensors have the shapes its config.json gives the model (read from the safetensors headers
    alone): `from_pretrained` refuses a mismatch only once the weights load, on every rank, after a report a screen
    long. A name matched neither as it is nor across the base model's prefix is left to transformers."""
    if getattr(config, "quantization_config", None) or not files:  # packed shapes; or .bin weights, not read here
        return
    from safetensors import safe_open

    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception:  # noqa: BLE001 - e.g. an attention implementation not installed here: from_pretrained says
        return
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
    prefix = f"{getattr(cls, 'base_model_prefix', '')}."
    wrong = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as weights:
                for name in weights.keys():
                    for key in (name, prefix + name, name.removeprefix(prefix)):
                        if key in shapes:
                            shape = weights.get_slice(name).get_shape()
                            if list(shape) != shapes[key]:
                                wrong.append(f"{name}: {list(shape)} in {f.name}, {shapes[key]} by config.json")
                            break
        except Exception as e:  # noqa: BLE001 - safetensors' own errors (a cut or empty file): one line naming it
            raise ConfigError(f"model.hf = {cfg.model.hf!r}: {f.name} does not read as safetensors "
                              f"({one_line(e, 120)}); a file cut short: copy or download the checkpoint whole") \
                from None
    if wrong:
        raise ConfigError(f"model.hf = {cfg.model.hf!r}: {len(wrong)} of its weights do not fit the model its "
                          f"config.json describes (e.g. {wrong[0]}); the config and the weights must come from the "
                          f"same checkpoint")


def own_tokenizer(cfg: RunConfig) -> bool:
    """Whether the run's tokens come from the Hugging Face model's own tokenizer (not the task's)."""
    return bool(cfg.model.hf) and cfg.model.hf_tokenizer


def load_config(cfg: RunConfig):
    transformers = transformers_module(f"model.hf = {cfg.model.hf!r}")
    source, _ = _config_source(cfg.model.hf)
    try:
        return transformers.AutoConfig.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):  # transformers' own message is a paragraph: the key to set, in one line
            raise ConfigError(f"model.hf = {cfg.model.hf!r}: its config names code of its own (auto_map), which "
                              f"runs when the model loads; set model.trust_remote_code = true only if you trust "
                              f"its source") from None
        raise ConfigError(f"model.hf = {cfg.model.hf!r}: {str(e).splitlines()[0].rstrip('.')}"
                          f"{_no_folder(source)}") from None


def takes_packed(cfg: RunConfig, auto_class: str) -> bool:
    """Whether the model builds its causal mask with transformers' masking utilities (`create_causal_mask`), which
    keep documents packed in one row apart when their positions restart (transformers >= 4.54)."""
    cls = model_class(cfg, auto_class, load_config(cfg))
    return cls is not None and hasattr(sys.modules[cls.__module__], "create_causal_mask")


TRAINING_ONLY = ("use_cache",)  # config overrides an export leaves out (the others: ids, labels, sizes stay)


def build(cfg: RunConfig, auto_class: str, **config_overrides) -> nn.Module:
    """The task's Hugging Face model: pretrained weights where `model.hf` has them, else initialised from its config;
    on the meta device (a `torch.device("meta")` context) always from the config."""
    transformers = transformers_module(f"model.hf = {cfg.model.hf!r}")
    cls = getattr(transformers, cfg.model.hf_class or auto_class)
    config = load_config(cfg)
    # what an export writes back (`save`): the source's own value of a setting for training alone
    saved = {key: getattr(config, key, None) for key in config_overrides if key in TRAINING_ONLY}
    for key, value in config_overrides.items():
        setattr(config, key, value)
    source, has_weights = _config_source(cfg.model.hf)
    on_meta = torch.empty(0).device.type == "meta"
    torch.manual_seed(cfg.train.seed)  # a from-config model's initial weights: the same on every rank
    load_own_share = PARTITIONED_LOADER.get()
    if has_weights and not on_meta and load_own_share is not None:
        model, how = load_own_share(cls, config, source, cfg.model.trust_remote_code)
        if model is None:
            how = f"transformers' loader (rank 0 reads the whole checkpoint): {how}"
            model = cls.from_pretrained(source, config=config, trust_remote_code=cfg.model.trust_remote_code)
        model.harness_loading = how  # said by parallel.build_engine
    elif has_weights and not on_meta:
        model = cls.from_pretrained(source, config=config, trust_remote_code=cfg.model.trust_remote_code)
    else:
        model = from_config(cls, config, cfg.model.trust_remote_code)
    model.harness_source_config = saved
    return model.train()


def from_config(cls, config, trust_remote_code: bool = False) -> nn.Module:
    """A model of `config` with fresh weights, through the auto class, or model.hf_class's model class itself."""
    if hasattr(cls, "from_config"):
        return cls.from_config(config, trust_remote_code=trust_remote_code)
    return cls(config)


def weight_files(source: str) -> list[Path]:
    """`source`'s safetensors weights on this machine: one file, or the shards its index names; [] where there are
    none. A hub id's are those of its snapshot in the Hugging Face cache, fetched there first (the index or the one
    file, then the shards it names) where `from_pretrained` would fetch them."""
    path = Path(source)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        try:
            path = Path(snapshot_download(source, allow_patterns=["model.safetensors", INDEX]))
            if shards := _shards(path):
                path = Path(snapshot_download(source, allow_patterns=shards))
        except (OSError, ValueError):  # not on the hub, or neither reachable nor cached: from_pretrained says which
            return []
    if shards := _shards(path):  # all of them, or none (the loader then falls back, saying why)
        return [path / name for name in shards] if all((path / name).is_file() for name in shards) else []
    return [path / "model.safetensors"] if (path / "model.safetensors").is_file() else []


INDEX = "model.safetensors.index.json"
LOADED = ("model.safetensors", "pytorch_model.bin")  # what from_pretrained reads, or NAME.index.json of its shards


def _shards(path: Path) -> list[str]:
    """The shard files a directory's safetensors index names, in its order ([] without an index)."""
    index = path / INDEX
    return list(dict.fromkeys(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else []


def logits(outputs) -> torch.Tensor:
    """The logits of a forward pass: a Hugging Face model returns an output object, the built-in models the tensor."""
    return getattr(outputs, "logits", outputs)


def is_hf(model: nn.Module) -> bool:
    """Whether `model` is a transformers model; never imports transformers (2 s) to find that it is not."""
    if "transformers" not in sys.modules:  # nothing built it
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def tokenizer_dir(cfg: RunConfig) -> str:
    """Where the model's tokenizer is: `model.hf`'s directory (or hub id), or the directory of its config.json."""
    source, has_weights = _config_source(cfg.model.hf)
    return source if has_weights else str(Path(source).parent)


def tokenizer(cfg: RunConfig):
    """The model's own tokenizer (AutoTokenizer), from `tokenizer_dir`."""
    transformers = transformers_module(f"model.hf = {cfg.model.hf!r}")
    where = tokenizer_dir(cfg)
    try:
        return transformers.AutoTokenizer.from_pretrained(where, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.hf = {cfg.model.hf!r}: no tokenizer in {where} ({one_line(e)}); "
                          f"save one there (tokenizer.save_pretrained) or use a directory that has one") from None


# A data set's text is text: "<|endoftext|>" or "</s>" written in it are those characters, not the special ids (a
# document boundary or padding the model would learn in the middle of a document)
AS_TEXT = {"add_special_tokens": False, "split_special_tokens": True}


class TextTokenizer:
    """A Hugging Face tokenizer behind the interface of the harness's own (`harness.data.tokenizer.Tokenizer`): piece ids
    without special tokens (the task adds its own end and begin ids), so prepared data reads the same either way.
    `bos_id` is the id the decoder starts from (a seq2seq model's `decoder_start_token_id`)."""

    def __init__(self, tok, bos_id: int | None = None):
        self.tok, self.bos_id = tok, bos_id
        self.pad_id, self.unk_id, self.eos_id = tok.pad_token_id, tok.unk_token_id, tok.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, **AS_TEXT)["input_ids"]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tok(list(texts), **AS_TEXT)["input_ids"]

    def encode_target_batch(self, texts: list[str]) -> list[list[int]]:
        """The target side: a tokenizer with a vocabulary per language (Marian) reads it with its target model."""
        return self.tok(text_target=list(texts), **AS_TEXT)["input_ids"]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def need_tokens(cfg: RunConfig, tok, task: str, *names: str) -> None:
    """Before launch: the special tokens (e.g. "pad_token") that a task needs of the model's tokenizer."""
    missing = [name for name in names if getattr(tok, f"{name}_id", None) is None]
    if missing:
        raise ConfigError(f"model.hf = {cfg.model.hf!r}: its tokenizer has no {', '.join(missing)}; the {task} task "
                          f"needs {', '.join(names)}")


def _record_dtype(config: Path, state: dict[str, torch.Tensor]) -> None:
    """The config's dtype is the weights' written (fp32 masters), not the live module's: a bf16 run's module is
    16-bit, and save_pretrained wrote that, so from_pretrained loaded the fp32 file as bf16."""
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), None)
    written = json.loads(config.read_text())
    keys = [k for k in ("dtype", "torch_dtype") if k in written]
    if dtype is not None and keys:
        config.write_text(json.dumps({**written, **{k: str(dtype).removeprefix("torch.") for k in keys}}, indent=2,
                                     sort_keys=True) + "\n")


def save(model: nn.Module, state: dict[str, torch.Tensor], tok, out: Path, generation: dict | None = None) -> Path:
    """A directory that `AutoModelFor...from_pretrained(out)` and `AutoTokenizer.from_pretrained(out)` load with no
    code of ours: the config, the consolidated fp32 weights and the tokenizer. `generation`: what its
    generation_config says beside the source's (the task's decoding, `generation_defaults`), so `generate()` on the
    export decodes as the run's evaluation did."""
    out.mkdir(parents=True, exist_ok=True)
    # the source's own values of what training overrode (use_cache: false while training, true for generate())
    configs = [c for c in (model.config, getattr(model, "generation_config", None)) if c is not None]
    source = getattr(model, "harness_source_config", {})
    wanted = [source, {**(generation or {}), **source}]  # the model's config, its generation_config
    trained = [{k: getattr(c, k) for k in w if hasattr(c, k)} for c, w in zip(configs, wanted)]
    for c, had, w in zip(configs, trained, wanted):
        for key in had:
            setattr(c, key, w[key])
    try:
        model.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    finally:
        for c, had in zip(configs, trained):
            for key, value in had.items():
                setattr(c, key, value)
    _record_dtype(out / "config.json", state)
    if tok is not None:
        tok.save_pretrained(str(out))
    return out
