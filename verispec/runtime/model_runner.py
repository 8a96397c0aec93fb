"""The model runner: one forward of a model over a batch of slots, each appending its own number
of new tokens to its request's positions in the paged KV cache (``verispec.runtime.kv_cache``).

This is the one entry point every kind of step uses:

- prefill: ``forward(slots, [prompt_ids ...])`` -> logits of each prompt's last token;
- decode: ``forward(slots, [[last_token] ...])``;
- speculative verify: ``forward(slots, [[last_token, d_1, .., d_n_r] ...], logits="all")`` ->
  the ``sum(n_r + 1)`` rows in the flattened layout of docs/design.md §2, then ``kv_cache.truncate``
  each slot to its committed length;
- early-exit drafting: ``forward(..., num_layers=N)`` runs the first N layers + norm + LM head
  (it writes only those layers' cache rows, which the verify forward later rewrites);
- a draft model: a second ``ModelRunner`` with its own KV cache over the same slot numbers.

On CUDA the runner uses the flat token layout (``LlamaForCausalLM.forward_flat``: one Triton
kernel per small op, attention over the cache by ``verispec.ops.model_ops.cache_attention``) and
replays captured CUDA graphs (``verispec.runtime.cuda_graphs``) for steps of a fixed number of new
tokens per request: ``capture([1, k + 1])`` captures decode and verify. A step whose requests feed
at most S tokens each replays the graph of the smallest captured S' >= S: each request's tokens
are padded to S' (the padding tokens write positions past the request's last real one, which are
dead — in the request's own blocks, or in the scratch block past them — and are never attended by
a real token, all of which come before them). Prefill and steps
larger than every graph run the same layout eagerly.

Penalties (docs/design.md §15). Once ``penalty_counts`` is set (before ``capture``), the captured
full-model steps also apply the repetition, frequency and presence penalties to their logits
(``ops.apply_penalties``) for the requests a ``StepPenalties`` names; a step that runs eagerly
leaves them to the caller, and says which it did in ``StepPenalties.applied``.

``ModelRunner`` is this module's class; the pieces of each layout are its bases: the padded CPU
batch in ``runtime.padded_layout``, the flat layout and its CUDA graphs in ``runtime.flat_layout``,
the hidden states kept for an EAGLE head in ``runtime.hidden_capture``.
"""

from __future__ import annotations

import numpy as np
import torch

from verispec.models.rope import rope_tables
from verispec.ops.backend import get_backend
from verispec.ops.tree_feed import TreeFeed
from verispec.runtime.cuda_graphs import CUDAGraphRunner
from verispec.runtime.flat_layout import FlatLayout, StepPenalties, ragged_arange
from verispec.runtime.hidden_capture import CapturedHidden, HiddenCapture
from verispec.runtime.kv_cache import DEFAULT_BLOCK_SIZE, BlockTables
from verispec.runtime.padded_layout import PaddedLayout, padding_groups
from verispec.runtime.state_cache import is_hybrid, make_cache

LOGITS_MODES = ("last", "all", "none")


# bfloat16 CPU matmuls of this many rows or more run in float32 (prefill; see ops.cpu_linear).
# Decode and verify steps keep a bfloat16 matmul: widening the LM head every step costs more than
# it saves there. With the compiled bfloat16 kernel (Backend.cpu) the crossover is later
# (docs/benchmarks.md).
CPU_UPCAST_ROWS = 16
CPU_UPCAST_ROWS_WITH_KERNEL = 32


class ModelRunner(FlatLayout, PaddedLayout, HiddenCapture):
    def __init__(
        self,
        model: torch.nn.Module,
        num_slots: int,
        max_model_len: int,
        device: torch.device | str = "cpu",
        kv_cache_dtype: torch.dtype | None = None,
        max_step_tokens: int = 1,
        enforce_eager: bool = False,
        flat_layout: bool | None = None,
        batch_invariant: bool = True,
        block_tables: BlockTables | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        num_layers: int | None = None,
    ) -> None:
        """``max_step_tokens``: the most new tokens per request a captured step may feed (k + 1
        for verify); ``flat_layout`` (default: on CUDA) runs the GPU path, also on CPU with the
        torch twins (tests); ``enforce_eager`` never replays graphs; ``batch_invariant=False``
        uses torch's matmul on the GPU path and torch's matmul and attention choices on the CPU path
        (faster at some sizes, rows depend on the batch). ``block_tables``: share another
        runner's KV blocks (a proposer's runner shares the target's); else the cache owns a pool
        of ``num_blocks`` blocks of ``block_size`` (default: every slot at full length).
        ``num_layers``: cache only the first N layers (early exit)."""
        self.model = model
        self.config = model.config
        self.device = torch.device(device)
        self.dtype = model.embed_weight.dtype
        self.max_model_len = max_model_len
        self.flat = self.device.type == "cuda" if flat_layout is None else flat_layout
        self.batch_invariant = batch_invariant
        self.backend = get_backend(self.device)  # every kernel this device runs
        # A hybrid's captured steps also take each request's number of real tokens (its padding
        # tokens must leave the recurrent states alone).
        self.hybrid = is_hybrid(self.config)
        self.graphs: CUDAGraphRunner | None = None
        # Hidden states an EAGLE head reads (set by its proposer before ``capture``): the
        # residual stream entering each listed layer, ``num_hidden_layers`` = the final-norm
        # output; every forward then keeps them in ``captured_hidden`` (captured steps too).
        self.capture_layers: tuple[int, ...] = ()
        self.captured_hidden: CapturedHidden | None = None
        # (output_counts [num_slots, V] int32, prompt_mask [num_slots, V] bool): set before
        # ``capture``, the captured full-model steps apply penalties (module docstring)
        self.penalty_counts: tuple[torch.Tensor, torch.Tensor] | None = None
        # (tokens per request, max depth) of the token trees whose verify ``capture_tree``
        # captures; set before the memory plan (``graph_output_bytes`` counts its logits)
        self.tree_graph: tuple[int, int] | None = None
        # Forwards of more new tokens than this (prefills) run in pieces of at most this many
        # (``_forward_in_pieces``); None: any size in one forward.
        self.max_forward_tokens: int | None = None
        self._paging = dict(block_tables=block_tables, block_size=block_size,
                            num_blocks=num_blocks, num_layers=num_layers)
        if self.flat:
            self._init_flat(num_slots, max_step_tokens, kv_cache_dtype, enforce_eager,
                            batch_invariant)
            return
        if kv_cache_dtype is None:
            # On CPU, SDPA over a bfloat16 cache is several times slower than over float32.
            kv_cache_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        if self.device.type == "cpu":
            # Batch invariant (the default): every matmul and attention row computed one way
            # whatever the number of rows (ops.cpu_linear.invariant_linear). Otherwise float32
            # products as one weight block per thread and bfloat16 ones of many rows (prefill)
            # widened to float32 (ops.cpu_linear.linear says why).
            upcast_rows = 0
            if self.dtype != torch.float32:
                upcast_rows = (CPU_UPCAST_ROWS_WITH_KERNEL if self.backend.cpu is not None
                               else CPU_UPCAST_ROWS)
            model.set_cpu_matmuls(torch.get_num_threads(), upcast_rows=upcast_rows,
                                  batch_invariant=batch_invariant, kernels=self.backend.cpu)
        # A hybrid (Mamba2 + attention) model also keeps recurrent state per slot and position.
        self.kv_cache = make_cache(self.config, num_slots, max_model_len, kv_cache_dtype,
                                   self.device, max_step_tokens=max_step_tokens, **self._paging)
        # Angles in float32, then rounded to the model dtype once (as HF does per forward).
        cos, sin = rope_tables(self.config, max_model_len)
        self.cos = cos.to(self.device, self.dtype)  # [max_model_len, head_dim]
        self.sin = sin.to(self.device, self.dtype)
        self._key_positions = torch.arange(max_model_len, device=self.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, V] float32 through the LM head."""
        return self.model.compute_logits(hidden, self.ops if self.flat else None)

    @torch.inference_mode()
    def verify(self, slots: list[int], last_token_ids: list[int], draft_token_ids: torch.Tensor,
               num_draft_tokens: np.ndarray,
               penalties: StepPenalties | None = None) -> torch.Tensor:
        """The verify forward: request b feeds its last committed token and its n_b drafts
        (``draft_token_ids`` [sum n_b] on the device, docs/design.md §2 order). Returns the
        ``sum(n_b + 1)`` rows of target logits, float32, in the flattened layout; a captured
        step also applies ``penalties`` (module docstring)."""
        counts = np.asarray(num_draft_tokens, dtype=np.int64) + 1
        if not self.flat:
            drafts = draft_token_ids.tolist()
            cu = np.concatenate([[0], np.cumsum(counts - 1)])
            return self.forward(slots, [[t] + drafts[cu[b]:cu[b + 1]] for b, t in
                                        enumerate(last_token_ids)], logits="all")
        self.kv_cache.check_append_many(slots, counts)
        width = int(counts.max())
        ids = np.zeros((len(slots), width), dtype=np.int64)
        ids[:, 0] = last_token_ids
        index = (np.repeat(np.arange(len(slots)) * width + 1, counts - 1)
                 + ragged_arange(counts - 1))  # the drafts' places in ids
        return self._forward_flat(slots, counts, ids, (index, draft_token_ids), "all", None,
                                  penalties)

    @torch.inference_mode()
    def forward(
        self,
        slots: list[int],
        token_ids: list[list[int]],
        logits: str = "last",
        num_layers: int | None = None,
        penalties: StepPenalties | None = None,
        tree: TreeFeed | None = None,
        first_tokens: tuple[np.ndarray, torch.Tensor] | None = None,
    ) -> torch.Tensor | None:
        """Append ``token_ids[i]`` to slot ``slots[i]`` and run the model over them.

        Parameters
        ----------
        slots : B distinct cache slots
        token_ids : B non-empty lists of new token ids (different lengths allowed)
        logits : ``"last"`` -> [B, vocab] float32 for each request's last new token;
            ``"all"`` -> [sum(len(t)), vocab] float32, request-major (docs/design.md §2 layout);
            ``"none"`` -> None (fill the cache only)
        num_layers : run only the first N layers (early exit); default all
        penalties : the requests' penalties, applied by a captured step (module docstring)
        tree : the tokens are slots of token trees (``ops.tree_feed``): positions by depth,
            attention to the context and the ancestors; one eager forward
        first_tokens : (rows [R] int, ids [R] on the device): row ``rows[j]``'s first token
            is ``ids[j]``, whatever ``token_ids`` holds there (tokens sampled by a step still
            queued: the flat layout copies them on the device; elsewhere they are read)

        Each slot's committed length grows by ``len(token_ids[i])``; roll back with
        ``self.kv_cache.truncate``.
        """
        if logits not in LOGITS_MODES:
            raise ValueError(f"logits must be one of {LOGITS_MODES}, got {logits!r}")
        cache = self.kv_cache
        counts = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=len(token_ids))
        limit = self.max_forward_tokens
        scatter = None
        if first_tokens is not None and len(first_tokens[0]):
            rows, ids = first_tokens
            if self.flat and tree is None and not (
                    limit is not None and logits != "all" and counts.sum() > limit):
                scatter = (np.asarray(rows, dtype=np.int64), ids)  # flat indices: * width below
            else:
                token_ids = [list(t) for t in token_ids]
                for row, token in zip(np.asarray(rows).tolist(), ids.tolist()):
                    token_ids[row][0] = token
        if (limit is not None and logits != "all" and not self.hybrid and tree is None
                and counts.sum() > limit):
            return self._forward_in_pieces(slots, token_ids, counts, logits, num_layers, limit)
        if not self.flat and tree is None:
            groups = padding_groups(counts)
            if len(groups) > 1:
                return self._forward_grouped(slots, token_ids, counts, groups, logits,
                                             num_layers)
        starts = cache.lengths_np[slots]
        cache.check_append_many(slots, counts)
        width = int(counts.max())
        if (counts == width).all():
            ids_np = np.asarray(token_ids, dtype=np.int64)
        else:
            ids_np = np.zeros((len(slots), width), dtype=np.int64)
            for row, t in enumerate(token_ids):
                ids_np[row, : len(t)] = t
        if self.flat:
            if scatter is not None:
                scatter = (scatter[0] * width, scatter[1])
            return self._forward_flat(slots, counts, ids_np, scatter, logits, num_layers,
                                      penalties, tree)
        meta, _, valid_index = self._metadata(slots, counts, starts, width, tree)
        input_ids = torch.from_numpy(ids_np).to(self.device)
        hidden = self._capture(slots, starts, counts, meta.valid_index, self.model(
            input_ids, meta, cache.k_layers, cache.v_layers, num_layers,
            **self._capture_kwargs()))
        cache.advance(slots, counts.tolist())
        if logits == "none":
            return None
        if logits == "last":
            if valid_index is None:
                rows = hidden[:, -1]
            else:
                rows = hidden[torch.arange(len(slots)), torch.from_numpy(counts - 1)]
        else:
            rows = hidden.reshape(-1, hidden.shape[-1])
            if valid_index is not None:
                rows = rows.index_select(0, meta.valid_index)
        return self.model.compute_logits(rows)

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int, num_logit_rows: int) -> int:
        """Bytes of device memory the largest eager steps take above what is allocated now (CUDA;
        the memory plan): a prefill of ``num_tokens`` tokens (written to the scratch block) and
        the float32 logits of ``num_logit_rows`` rows with one softmax over them (a verify step
        of every slot and its sampling)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        if self.flat:
            hidden = self._scratch_forward(
                np.array([min(num_tokens, self.max_model_len)], dtype=np.int64))
            rows = hidden[-1:].expand(num_logit_rows, -1).contiguous()
            del hidden
            logits = self.compute_logits(rows)
            probs = torch.softmax(logits, dim=-1)
            del rows, logits, probs
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        return int(peak * 1.05) + (64 << 20)  # headroom for allocator fragmentation

    # Requests of the eager steps ``warm_up_kernels`` runs: the attention kernel is specialised on
    # its request count (1, a multiple of 16, any other: Triton's integer specialisation)
    WARM_UP_BATCHES = (2, 16)
    WARM_UP_CHUNK = 32  # a chunk's tokens: the prefill launches (more than 16 a request)

    @torch.inference_mode()
    def warm_up_kernels(self) -> None:
        """Compile, at start-up, the kernel variants a prefill step beside decodes meets, which
        no captured graph and no profile step compiles (CUDA flat layout; a no-op elsewhere).
        Without it they compiled in the first mixed steps of a fresh machine: 4 attention
        variants, 5.1 s more for the first 300 requests of the throughput workload (14.1
        against 9.0 s, H200; docs/benchmarks.md). Each step: a chunk of ``WARM_UP_CHUNK``
        tokens and single-token rows, all on the scratch slot (its rows are never read)."""
        if not self.flat or self.device.type != "cuda" or self.hybrid:
            return
        chunk = min(self.WARM_UP_CHUNK, self.max_model_len)  # positions the tables hold
        for batch_size in self.WARM_UP_BATCHES:
            self._scratch_forward(np.array([chunk] + [1] * (batch_size - 1), dtype=np.int64))
        torch.cuda.synchronize(self.device)

    def _scratch_forward(self, counts: np.ndarray) -> torch.Tensor:
        """An eager flat forward of ``len(counts)`` requests feeding ``counts[b]`` tokens each
        from position 0, all on the scratch slot (its rows are never read): the final hidden
        states [sum(counts), hidden]."""
        num = len(counts)
        batch = self.flat_batch([self.kv_cache.block_tables.scratch_slot] * num, counts,
                                np.zeros(num, dtype=np.int64))
        kwargs = {"counts": torch.tensor(counts, device=self.device)} if self.hybrid else {}
        ids = torch.zeros(int(counts.sum()), dtype=torch.int64, device=self.device)
        hidden = self.model.forward_flat(ids, batch, self.kv_cache.k_layers,
                                         self.kv_cache.v_layers, None, **kwargs)
        return hidden[0] if isinstance(hidden, tuple) else hidden

    def _forward_in_pieces(self, slots: list[int], token_ids: list[list[int]],
                           counts: np.ndarray, logits: str, num_layers: int | None,
                           limit: int) -> torch.Tensor | None:
        """``forward`` of more than ``limit`` new tokens as several forwards of at most
        ``limit`` (a request's tokens in order, each piece attending to the cache the earlier
        ones wrote), so a step's activation memory is bounded. Batch invariance makes the
        logits and the cache those of one forward; the captured hidden states are joined."""
        pieces: list[list[tuple[int, int, int]]] = [[]]  # per forward: (request, lo, hi)
        room = limit
        for b, n in enumerate(counts.tolist()):
            lo = 0
            while lo < n:
                if room == 0:
                    pieces.append([])
                    room = limit
                hi = min(n, lo + room)
                pieces[-1].append((b, lo, hi))
                room -= hi - lo
                lo = hi
                if lo < n:  # the rest of this request goes to the next forward
                    room = 0
        starts = self.kv_cache.lengths_np[slots].copy()
        last_rows: dict[int, torch.Tensor] = {}
        captured: dict[int, list[torch.Tensor]] = {b: [] for b in range(len(slots))}
        for piece in pieces:
            sub_slots = [slots[b] for b, _, _ in piece]
            sub_tokens = [list(token_ids[b][lo:hi]) for b, lo, hi in piece]
            out = self.forward(sub_slots, sub_tokens, "none" if logits == "none" else "last",
                               num_layers)
            kept = self.captured_hidden
            for i, (b, lo, hi) in enumerate(piece):
                if out is not None and hi == counts[b]:
                    last_rows[b] = out[i]
                if self.capture_layers and kept is not None:
                    start = int(kept.row_start[i])
                    captured[b].append(kept.rows[start:start + hi - lo])
        if self.capture_layers:
            rows = torch.cat([r for b in range(len(slots)) for r in captured[b]])
            self.captured_hidden = CapturedHidden(list(slots), starts, counts.copy(),
                                                  np.cumsum(counts) - counts, rows)
        if logits == "none":
            return None
        return torch.stack([last_rows[b] for b in range(len(slots))])
