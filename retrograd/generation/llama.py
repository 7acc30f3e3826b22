"""Text generation on llama.cpp (through llama-cpp-python's low-level API, sharing the process's one
ggml): many sequences decoded in one batch, each with its own sampler settings and RNG, the
prompt's KV cache shared by all sequences of a group, and the LoRA adapter swapped in from memory
(a GGUF in a byte buffer opened with fmemopen, never a temporary file).

Sampling happens on the host from the logits (temperature, top-k, top-p, seeded), so each
sequence's token log-probabilities under the model come back with the text.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from pathlib import Path

import llama_cpp.llama_cpp as lc
import numpy as np

from retrograd.data.tokenizer import Tokenizer, quiet_llama_logs
from retrograd.errors import GenerationError
from retrograd.generation import split
from retrograd.generation.adapter_slot import AdapterSlot
from retrograd.generation.joint import JointAdapter
from retrograd.generation.sampling import Completion, SamplingParams, sample
from retrograd.logs import log
from retrograd.run_setup import resolve_threads

#: a prompt's token ids: a list, or an int32 array as data.formats.Example.tokens holds them
TokenIds = Sequence[int] | np.ndarray


def extra_buffers_safe() -> bool:
    """Whether llama.cpp may move weights into its extra CPU buffer types (repacked layouts, AMX).
    Not on CPUs with AMX: a native build there puts Q4_1, Q4_K and Q8_0 weights in the AMX buffer
    type, and the pinned version's ggml_backend_amx_mul_mat crashes (SIGSEGV) on batched decodes
    of several sequences (seen on a Xeon with AMX-INT8 running
    tests/agent/test_agent_rollouts.py). Its AMX kernels also set the tile configuration once per
    thread and assume it stays, where the training graph's AMX product (native/gemm_amx.c) runs on
    the same OpenMP threads. The weights then stay in the plain CPU buffer, which runs the kernels
    llama.cpp uses on every other x86 CPU."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_int8" not in line.split()
    except OSError:
        pass
    return True


def plain_llama(path: str | os.PathLike, *, extra_buffers: bool = True, **kw):
    """llama-cpp-python's high-level `Llama` on `path` (benchmarks and tests compare with it), its
    weights in llama.cpp's extra CPU buffers only where asked and safe (extra_buffers_safe): `Llama`
    has no argument for it, so its default model parameters are swapped while it loads."""
    from llama_cpp import Llama

    orig = lc.llama_model_default_params

    def params():
        p = orig()
        p.use_extra_bufts = extra_buffers and extra_buffers_safe()
        return p

    lc.llama_model_default_params = params
    try:
        return Llama(model_path=str(path), verbose=False, **kw)
    finally:
        lc.llama_model_default_params = orig


def group_kv_cells(groups: int, n_ctx: int, n_seq: int, max_new_tokens: int) -> int:
    """KV cells for n_seq sequences continuing `groups` prompts (generate_groups, or generate with one
    prompt): a group's sequences share their prompt's cells, so the prompts once (each within n_ctx),
    then every sequence's completion (and a few cells of slack each)."""
    return groups * n_ctx + n_seq * (max_new_tokens + 8)


class Generator(AdapterSlot):
    """A llama.cpp model and context for generation, with an adapter slot (adapter_slot.py)."""

    def __init__(self, model_path: str | os.PathLike, *, n_ctx: int = 2048, n_seq: int = 1,
                 threads: int | None = None, device: str = "auto", kv_cells: int | None = None) -> None:
        """n_ctx: tokens a sequence may reach; n_seq: sequences decoded together; kv_cells: the KV
        cache's cells when the caller knows its sequences share their prompts (GRPO's groups: the
        prompts once, then each sequence's completion), else n_ctx x n_seq."""
        quiet_llama_logs()
        if device not in ("auto", "cpu"):
            # the same check and error as the training engine's: --device gpu without a GPU fails here,
            # instead of llama.cpp quietly keeping every layer on the CPU
            from retrograd import native

            native.select_device(device)
        self.path = Path(model_path)
        self.tokenizer = Tokenizer(self.path)
        self.n_seq = max(1, n_seq)
        self.n_ctx = n_ctx
        full = n_ctx * self.n_seq
        self.kv_cells = full if kv_cells is None else max(n_ctx, min(int(kv_cells), full))
        self._threads = threads or resolve_threads()
        self._gpu_layers = 0 if device == "cpu" else 999
        self._adapter = None
        self._merged: Path | None = None       # a DoRA adapter's merged model, when loaded instead
        self._trained = False                  # whether a training adapter is in
        self._open(self.path)

    def _open(self, path: Path) -> None:
        """Load `path`'s weights with a fresh context (the tokenizer stays: a merged model has the same)."""
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = self._gpu_layers
        mp.use_extra_bufts = extra_buffers_safe()
        # a split copy's weights are mostly repacked into buffers of llama.cpp's own: read, not mapped,
        # or the mapping's pages would stay resident beside the repacked copies
        if split.is_split(path):
            mp.load_mode = lc.LLAMA_LOAD_MODE_NONE
        self._model = lc.llama_model_load_from_file(str(path).encode(), mp)
        if not self._model:
            raise GenerationError(f"{path}: llama.cpp could not load the model")
        cp = lc.llama_context_default_params()
        cp.n_ctx = self.kv_cells
        cp.n_batch = max(512, self.n_ctx)
        cp.n_ubatch = 512
        cp.n_seq_max = self.n_seq
        cp.kv_unified = True     # sequences of a group share the prompt cells
        cp.n_threads = cp.n_threads_batch = self._threads
        self._ctx = lc.llama_init_from_model(self._model, cp)
        if not self._ctx:
            lc.llama_model_free(self._model)
            raise GenerationError(f"{path}: llama.cpp could not create a context of {cp.n_ctx} tokens")
        log.info("generator %s: %d sequences x %d tokens (%d KV cells), %s layers on the GPU", path.name, self.n_seq,
                 self.n_ctx, self.kv_cells, "no" if self._gpu_layers == 0 else "all")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self._model))
        self._mem = lc.llama_get_memory(self._ctx)
        self._batch_cap = max(512, self.n_seq)
        self._batch = lc.llama_batch_init(self._batch_cap, 0, 1)
        self._cache: list[int] = []    # tokens in sequence 0's KV cache, for prefix reuse
        # freed in this order when close() is called or the generator is collected (never twice)
        self._free = weakref.finalize(self, _free_llama, self._batch, self._ctx, self._model)
        # a split copy's block offsets (split.py) are part of its weights: joined to every adapter
        # swapped in, and alone until one is (joint.py)
        self._joint = JointAdapter.of(path) if split.marked(self._model) else None
        if self._joint is not None:
            self._adapter = self._joint.load(self._model, None)
            self._apply(self._adapter)

    def _reopen(self, path: Path) -> None:
        self._free()
        self._open(path)

    # ---- decoding ----------------------------------------------------------------------------
    def _decode(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int],
                logits: Sequence[bool]) -> None:
        n = len(tokens)
        batch = self._batch
        for s in range(0, n, self._batch_cap):
            e = min(n, s + self._batch_cap)
            for i in range(s, e):
                j = i - s
                batch.token[j] = tokens[i]
                batch.pos[j] = positions[i]
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = seqs[i]
                batch.logits[j] = logits[i]
            batch.n_tokens = e - s
            rc = lc.llama_decode(self._ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc}): KV cache of {self.kv_cells} cells "
                                   f"({self.n_seq} sequences x {self.n_ctx} tokens) too small?")

    def _last_row(self, n: int) -> int:
        """Index, within the last llama_decode call, of the last of n tokens decoded in chunks."""
        return (n - 1) % self._batch_cap

    def _logits(self, i: int) -> np.ndarray:
        return np.ctypeslib.as_array(lc.llama_get_logits_ith(self._ctx, i), shape=(self.n_vocab,)).copy()

    def _step_logits(self, n: int) -> np.ndarray:
        """The last decode's n rows of logits, in llama.cpp's buffer: valid until the next decode.
        Not copied: a batch's rows are megabytes, and with the mmap threshold memory.py sets each
        copy would be a fresh mapping, faulted in page by page every step."""
        return np.ctypeslib.as_array(lc.llama_get_logits(self._ctx), shape=(n, self.n_vocab))

    def _prefill(self, prompt: TokenIds, n_seq: int) -> np.ndarray:
        """Put the prompt in sequence 0 (reusing the cached prefix) and share it with 1..n_seq-1."""
        if len(prompt) + 1 > self.n_ctx:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit the context of {self.n_ctx}")
        common = 0
        while common < min(len(prompt) - 1, len(self._cache)) and self._cache[common] == prompt[common]:
            common += 1
        lc.llama_memory_seq_rm(self._mem, 0, common, -1)
        for s in range(1, self.n_seq):
            lc.llama_memory_seq_rm(self._mem, s, -1, -1)
        rest = list(prompt[common:])
        self._decode(rest, range(common, len(prompt)), [0] * len(rest), [False] * (len(rest) - 1) + [True])
        self._cache = list(prompt)
        last = self._logits(self._last_row(len(rest)))
        for s in range(1, n_seq):
            lc.llama_memory_seq_cp(self._mem, 0, s, -1, -1)
        return last

    def _prefill_shared(self, prompts: Sequence[TokenIds], copies: Sequence[int]) -> int:
        """The prefix all prompts share, decoded once in sequence 0 (reusing the cached one) and copied
        to the sequences in `copies`; returns its length."""
        longest = max(len(p) for p in prompts)
        if longest + 1 > self.n_ctx:
            raise ValueError(f"a prompt of {longest} tokens does not fit the context of {self.n_ctx}")
        shared, first = 0, prompts[0]
        while shared < min(len(p) for p in prompts) - 1 and all(p[shared] == first[shared] for p in prompts):
            shared += 1
        self._prefill(first[:shared + 1], 1)          # the prefix (and one token more) in sequence 0
        lc.llama_memory_seq_rm(self._mem, 0, shared, -1)
        self._cache = list(first[:shared])
        for s in copies:
            lc.llama_memory_seq_cp(self._mem, 0, s, -1, -1)
        return shared

    def _prefill_each(self, prompts: Sequence[TokenIds]) -> tuple[dict[int, np.ndarray], int]:
        """Different prompts, one per sequence: their common prefix once in sequence 0 (reusing the
        cached one), shared with the others, then each prompt's own rest. Returns the logits after
        each prompt and the length of the shared prefix."""
        shared = self._prefill_shared(prompts, range(1, len(prompts)))
        logits = {}
        for s, p in enumerate(prompts):
            rest = list(p[shared:])
            self._decode(rest, range(shared, len(p)), [s] * len(rest), [False] * (len(rest) - 1) + [True])
            logits[s] = self._logits(self._last_row(len(rest)))
        return logits, shared

    def generate(self, prompt: TokenIds, params: Sequence[SamplingParams]) -> list[Completion]:
        """Continue one prompt len(params) times in one batch (a GRPO group, or a single answer)."""
        n = len(params)
        if n > self.n_seq:
            raise ValueError(f"{n} sequences requested, the context was made for {self.n_seq}")
        first = self._prefill(prompt, n)
        self._cache = list(prompt)       # sequence 0 grows past the prompt; only the prompt is reusable
        outs = self._sample({s: first for s in range(n)}, [len(prompt)] * n, params)
        self._cache = list(prompt)
        lc.llama_memory_seq_rm(self._mem, 0, len(prompt), -1)
        return outs

    def generate_each(self, prompts: Sequence[TokenIds], params: Sequence[SamplingParams]) -> list[Completion]:
        """Continue each prompt once, all in one batch: the turns of a group of conversations whose
        histories have parted (their common prefix is decoded once)."""
        n = len(params)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} sampling settings")
        if n > self.n_seq:
            raise ValueError(f"{n} sequences requested, the context was made for {self.n_seq}")
        if all(list(p) == list(prompts[0]) for p in prompts):
            return self.generate(prompts[0], params)
        logits, shared = self._prefill_each(prompts)
        outs = self._sample(logits, [len(p) for p in prompts], params)
        lc.llama_memory_seq_rm(self._mem, 0, shared, -1)
        self._cache = list(prompts[0][:shared])
        return outs

    def generate_groups(self, prompts: Sequence[TokenIds],
                        params: Sequence[Sequence[SamplingParams]]) -> list[list[Completion]]:
        """Continue prompt g len(params[g]) times, every group in one batch: a GRPO step's groups
        decode together, so each decode step reads the weights once for all of them. The prefix the
        prompts share is decoded once, each prompt once, and copied to its group's sequences."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts for {len(params)} groups")
        n = sum(len(p) for p in params)
        if n > self.n_seq:
            raise ValueError(f"{n} sequences requested, the context was made for {self.n_seq}")
        if len(prompts) == 1:
            return [self.generate(prompts[0], params[0])]
        bases = [0]
        for ps in params[:-1]:
            bases.append(bases[-1] + len(ps))
        shared = self._prefill_shared(prompts, bases[1:])
        logits, pos, flat = {}, [], []
        for b, prompt, ps in zip(bases, prompts, params):
            rest = list(prompt[shared:])
            self._decode(rest, range(shared, len(prompt)), [b] * len(rest), [False] * (len(rest) - 1) + [True])
            last = self._logits(self._last_row(len(rest)))
            for s in range(b, b + len(ps)):
                if s != b:
                    lc.llama_memory_seq_cp(self._mem, b, s, -1, -1)
                logits[s] = last
                pos.append(len(prompt))
            flat += list(ps)
        outs = self._sample(logits, pos, flat)
        lc.llama_memory_seq_rm(self._mem, 0, shared, -1)
        for s in range(1, n):
            lc.llama_memory_seq_rm(self._mem, s, -1, -1)
        self._cache = list(prompts[0][:shared])
        return [outs[b:b + len(ps)] for b, ps in zip(bases, params)]

    def _sample(self, logits: dict[int, np.ndarray], pos: list[int], params: Sequence[SamplingParams]) -> list[Completion]:
        """Sample every sequence to its end, one batched decode per step; pos[s] is where sequence
        s writes its next token."""
        n = len(params)
        tok = self.tokenizer
        outs = [Completion() for _ in range(n)]
        rngs = [np.random.default_rng(p.seed & (2**64 - 1)) for p in params]     # any integer seed, negative too
        active = list(range(n))
        pos = list(pos)
        while active:
            step_tokens, step_seqs, step_pos = [], [], []
            for s in list(active):
                t, lp = sample(logits[s], params[s], rngs[s])
                if not outs[s].take(t, lp, params[s], tok, pos[s] + 1 >= self.n_ctx):
                    active.remove(s)
                    continue
                step_tokens.append(t)
                step_seqs.append(s)
                step_pos.append(pos[s])
            if not step_tokens:
                break
            self._decode(step_tokens, step_pos, step_seqs, [True] * len(step_tokens))
            rows = self._step_logits(len(step_seqs))      # sampled from before the next decode
            logits = {s: rows[i] for i, s in enumerate(step_seqs)}
            for s in step_seqs:
                pos[s] += 1
        for o, p in zip(outs, params):
            o.finish_text(p, tok)
        return outs

    def close(self) -> None:
        self._free()


def _free_llama(batch, ctx, model) -> None:
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)
