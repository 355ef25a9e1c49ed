"""The interface every language implements, and the token-id convention shared by data and models."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from flatlm.errors import UserError


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """Special token ids; they come after the language's V words (ids 0..V-1)."""

    pad: int
    mask: int
    cls: int

    @property
    def vocab_size(self) -> int:
        """Size of the model's input embedding: V words + pad, mask, cls."""
        return self.cls + 1


def special_ids(num_words: int) -> SpecialIds:
    """pad = V, mask = V + 1, cls = V + 2."""
    return SpecialIds(pad=num_words, mask=num_words + 1, cls=num_words + 2)


@dataclasses.dataclass
class Corpus:
    """A batch of sentences from a language.

    tokens: int32[n, T] word ids, padded with `pad` (= V) beyond each length.
    lengths: int32[n] number of words of each sentence.
    latents: language-specific latent variables (e.g. HMM hidden states int32[n, T]; PCFG parse trees).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    latents: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class Language(Protocol):
    """What the data pipeline, the evaluators and the lookup-table baseline need from a language.

    Optional: `sample_blocks(ns, seeds, latents)`, the sentences of `sample(ns[b], seeds[b], latents)` for every
    block b, concatenated, in one pass (the PCFG, the HMM); `sample_blocks(language, ...)` below falls back to
    one `sample` call per block."""

    vocab_size: int
    max_length: int

    def sample(self, n: int, seed: int, latents: bool = True) -> Corpus:
        """n sentences, deterministic in `seed`: tokens int32[n, T] (padded), lengths int32[n], latents (an empty
        dict with `latents=False`, the same sentences: a PCFG then skips building its parse trees)."""
        ...

    def log_prob(self, tokens, lengths):
        """Exact log P(x) in nats, float[n]."""
        ...

    def conditionals(self, tokens, lengths):
        """Exact q[n, T, V] with q[b, t, w] = P(x_t = w | x_-t) for t < lengths[b], 0 beyond."""
        ...


def sample_blocks(language: Language, ns, seeds, latents: bool = True) -> Corpus:
    """The sentences of `language.sample(ns[b], seeds[b], latents)` for every block b, concatenated in block order:
    by the language's own one-pass `sample_blocks` where it has one, else one `sample` call per block (the stream
    source's batch of `data.stream_block`-row blocks)."""
    if hasattr(language, "sample_blocks"):
        return language.sample_blocks(ns, seeds, latents=latents)
    corpora = [language.sample(n, seed=seed, latents=latents) for n, seed in zip(ns, seeds, strict=True)]
    return Corpus(np.concatenate([c.tokens for c in corpora]), np.concatenate([c.lengths for c in corpora]),
                  {k: np.concatenate([c.latents[k] for c in corpora]) for k in corpora[0].latents})


def exact_dot(a, b):
    """a @ b at full float32 precision, for exact inference (HMM, PCFG, the OPT teacher). XLA:GPU runs float32
    dots on TF32 by default: on an H200 (2026-11-29) the HMM's conditionals then summed to 1 +- 3.2e-4 and were off
    by up to 9e-4 relative (7e-6 at full precision, 3.0M vs 3.25M sentences/s end to end). The CPU's bits do not
    change."""
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def exact_einsum(spec: str, *operands):
    """`jnp.einsum` at full float32 precision (see `exact_dot`)."""
    return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST)


HOST_TRANSFER_ENV = "FLATLM_HOST_TRANSFER"
HOST_TRANSFERS = ("pageable", "pinned")


def host_transfer(device=None) -> str:
    """How inference kernels' outputs on `device` (None: JAX's first) reach numpy: $FLATLM_HOST_TRANSFER (read at
    each call, so one process can compare both), else "pinned" on an accelerator with pinned host memory (GPUs,
    TPUs; measured on an H200 only) and "pageable" on the CPU and on a backend without it; see `start_host_copy`."""
    device = device or jax.devices()[0]
    pinned = device.platform != "cpu" and any(m.kind == "pinned_host" for m in device.addressable_memories())
    how = os.environ.get(HOST_TRANSFER_ENV) or ("pinned" if pinned else "pageable")
    if how not in HOST_TRANSFERS:
        raise UserError(f"{HOST_TRANSFER_ENV}={how!r} is not one of {', '.join(HOST_TRANSFERS)}; unset it or pick one")
    return how


def start_host_copy(x: jax.Array) -> jax.Array:
    """Start x's copy to host memory without waiting for it; `np.asarray(result)` then reads it.

    "pageable": `copy_to_host_async`, then `np.asarray` makes numpy's copy (on the CPU backend x already is in
    host memory and `np.asarray` shares it). "pinned": a `device_put` into the device's pinned host memory, one
    DMA that `np.asarray` reads in place (checked on the CPU backend; jax-ml/jax#22114 relies on it on GPUs).
    Why pinned on accelerators: JAX's device-to-host copy into pageable memory stages through a bounded buffer,
    and the HMM's conditionals are 12.8 kB a sentence. On an H200 (benchmarks/RESULTS.md, 2026-11-29) one chunk of
    them reached numpy at 1.34 GB/s pageable and 50.3 GB/s pinned (torch's pinned copy: 55.3); end to end the HMM
    ran at 126k vs 3.31M sentences/s in one call, the released PCFG at 90k vs 188k. On the CPU "pinned" costs one
    more copy (`FLATLM_HOST_TRANSFER=pinned` runs it there so that the tests check it)."""
    if host_transfer(next(iter(x.devices()))) == "pinned":
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    x.copy_to_host_async()
    return x


def host_outputs(outputs):
    """Yield each device output (an array or a dict of arrays) of the iterable `outputs` as numpy, in order, one
    behind: output i's copy starts as it arrives (`start_host_copy`) and is read only after output i + 1 has been
    pulled, i.e. dispatched when `outputs` is a generator that calls the kernel: the device computes the next
    chunk while the previous one travels to the host."""
    read = lambda out: jax.tree.map(np.asarray, out)  # noqa: E731
    pending = None
    for out in outputs:
        started = jax.tree.map(start_host_copy, out)
        if pending is not None:
            yield read(pending)
        pending = started
    if pending is not None:
        yield read(pending)
