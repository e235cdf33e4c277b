"""Settings into a running server: the model, its speculator, the engine with its prefix cache, and
the HTTP limits. The CLI, the Ray integration, the benchmarks and the tests all build here."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch

from hybridlm.settings.declared import DEMO_MODEL_NAME, Settings
from hybridlm.settings.values import torch_dtype

log = logging.getLogger("hybridlm")


def load(settings: Settings):
    """The model behind `settings.model` (the demo model when None), with a progress bar on stderr."""
    from tqdm import tqdm

    from hybridlm import load_model
    from hybridlm.engine import serial_setup

    bar = tqdm(total=3, desc="loading model", unit="step", file=sys.stderr, disable=None, leave=False)
    with bar, serial_setup():
        path = settings.model
        if path is None:
            from hybridlm.demo import demo_model_dir

            bar.set_postfix_str("demo checkpoint")
            path = demo_model_dir()
        bar.update()
        bar.set_postfix_str("weights")
        dtype = torch_dtype(settings.dtype)
        model = load_model(path, dtype=dtype, device=settings.device, quantize=settings.quantize)
        bar.update()
        bar.set_postfix_str("warm-up")
        model.warm_up()
        bar.update()
    if model.tokenizer is None:
        raise SystemExit(f"hybridlm: {model.path} has no tokenizer.json")
    return model


def served_name(settings: Settings, model) -> str:
    """The model id clients send: --model-name, else the checkpoint directory's name."""
    return settings.model_name or (DEMO_MODEL_NAME if settings.model is None else model.path.name)


def make_speculator(model, settings: Settings):
    """The `Speculator` behind --speculative (None when off)."""
    if settings.speculative is None:
        return None
    from hybridlm.engine import serial_setup
    from hybridlm.models.checkpoint import CheckpointError
    from hybridlm.ops.native import FEW_TOKENS
    from hybridlm.speculative import MTP, NgramDrafter, Speculator, load_draft

    depth = settings.num_draft
    if not 1 <= depth <= FEW_TOKENS - 1:
        # Longer verify passes would leave the per-token CPU kernels, and bf16 greedy output could
        # then differ from plain decoding.
        raise SystemExit(f"hybridlm: --num-draft must be in [1, {FEW_TOKENS - 1}], got {depth}")
    if settings.speculative == "ngram":
        return Speculator(NgramDrafter, max_depth=depth)
    if settings.speculative == "mtp":
        try:
            with serial_setup():
                return Speculator(MTP.load(model.path, model.lm), max_depth=depth)
        except CheckpointError as e:
            raise SystemExit(f"hybridlm: --speculative mtp: {e}") from None
    if settings.draft_model is None:
        raise SystemExit("hybridlm: --speculative draft needs --draft-model DIR")
    try:
        dtype = torch_dtype(settings.dtype)
        with serial_setup():
            draft = load_draft(settings.draft_model, model.lm, dtype=dtype, quantize=settings.draft_quantize)
    except ValueError as e:  # an unloadable checkpoint, or an assistant that does not fit this model
        raise SystemExit(f"hybridlm: --draft-model {settings.draft_model}: {e}") from None
    mine, theirs = Path(model.path) / "tokenizer.json", Path(settings.draft_model) / "tokenizer.json"
    if theirs.exists() and mine.exists() and theirs.read_bytes() != mine.read_bytes():
        log.warning(
            "the draft model's tokenizer.json differs from the model's: drafts may rarely be accepted"
        )
    return Speculator(draft, max_depth=depth)


def make_prefix_cache(model, settings: Settings, speculative):
    """The prefix cache with the tiers the settings ask for (None with --no-prefix-cache)."""
    if settings.no_prefix_cache:
        return None
    from hybridlm.engine import serial_setup
    from hybridlm.prefix.cache import PrefixCache
    from hybridlm.prefix.disk import DiskTier, model_fingerprint
    from hybridlm.speculative import DraftModel

    # Whatever it allocates here must not make this thread an OpenMP pool of its own beside the
    # engine's: every decode step would pay the futex wake-ups `serial_setup` describes.
    with serial_setup():
        disk = None
        if settings.cache_dir:
            try:
                disk = DiskTier(settings.cache_dir, settings.cache_disk, model_fingerprint(model.lm))
            except OSError as e:  # a file of that name, no permission to create it...
                log.warning(
                    "prefix cache: --cache-dir %s is unusable (%s); no disk tier", settings.cache_dir, e
                )
        # A draft model keeps caches of its own: the prefix cache stores them too (an assistant, MTP
        # heads and n-grams keep none).
        drafter = speculative.make_drafter if speculative is not None else None
        draft = drafter.model if isinstance(drafter, DraftModel) else None
        store = None
        if settings.cache_store:
            from hybridlm.prefix.store import StoreTier

            store = StoreTier(settings.cache_store, model_fingerprint(model.lm), replica=settings.replica)
        return PrefixCache(model.lm, ram_budget=settings.cache_ram, disk=disk, draft=draft, store=store)


def make_engine(model, settings: Settings):
    """The engine serving `model` (an `api.Model`) as the settings say, speculator and prefix cache
    included."""
    from hybridlm.engine import Engine

    speculative = make_speculator(model, settings)
    return Engine(
        model.lm,
        model.tokenizer,
        prefill_chunk=settings.prefill_chunk,
        max_queue=settings.max_queue,
        context_length=settings.context_length,
        prefix=make_prefix_cache(model, settings, speculative),
        speculative=speculative,
        max_running=settings.max_running,
        max_batch_tokens=settings.max_batch_tokens,
        prefill_share=settings.prefill_share,
    )


def limits(settings: Settings):
    """What one request may cost the HTTP server."""
    from hybridlm.server.app import Limits

    return Limits(
        max_body=settings.max_body,
        read_timeout=settings.read_timeout,
        max_connections=settings.max_connections,
    )


def summary(model, engine, settings: Settings, kernel_fallbacks: list[str]) -> str:
    """One line saying what was loaded and how it will run."""
    lm = model.lm
    params = sum(p.numel() for p in lm.parameters())
    dtype = str(next(lm.parameters()).dtype).removeprefix("torch.")
    if os.environ.get("HYBRIDLM_COMPILE", "1") == "0":
        kernels = "off (HYBRIDLM_COMPILE=0)"
    elif kernel_fallbacks:
        kernels = "fell back to torch for " + ", ".join(kernel_fallbacks)
    else:
        kernels = "compiled"
    prefix = engine.prefix
    if prefix is None:
        cache = "off"
    else:
        cache = f"ram {settings.cache_ram / 2**20:.0f} MiB"
        if prefix.disk is not None:
            cache += f", disk {settings.cache_disk / 2**20:.0f} MiB at {prefix.disk.directory}"
        if prefix.store is not None:
            from urllib.parse import urlsplit

            where = urlsplit(prefix.store.url)  # never the password
            cache += f", shared store {where.hostname}:{where.port or 6379}{where.path or '/0'}"
    return (
        f"hybridlm: loaded {lm.config.get('model_type', type(lm).__name__)} from {model.path} "
        f"({params / 1e6:.1f}M parameters, {dtype}, {lm.device}, {torch.get_num_threads()} threads; "
        f"kernels {kernels}; prefix cache {cache}; speculative {settings.speculative or 'off'}; "
        f"context {engine.context_length} tokens)"
    )
