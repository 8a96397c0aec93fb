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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verispec import ops
from verispec.models.llama import AttentionMetadata, FlatBatch
from verispec.models.rope import rope_tables
from verispec.ops import to_device
from verispec.ops.backend import get_backend
from verispec.ops.tree_feed import TreeFeed
from verispec.runtime.cuda_graphs import CUDAGraphRunner, StepInput, bucket_for
from verispec.runtime.kv_cache import DEFAULT_BLOCK_SIZE, BlockTables
from verispec.runtime.state_cache import is_hybrid, make_cache

LOGITS_MODES = ("last", "all", "none")


@dataclass
class CapturedHidden:
    """Hidden states of every token fed by the runner's last forward (``capture_layers``):
    slot ``slots[b]`` fed ``counts[b]`` tokens at positions ``starts[b] ..``, whose rows are
    ``rows[row_start[b] : row_start[b] + counts[b]]``. After a replayed graph ``rows`` is the
    graph's output buffer (padded layout), which its next replay overwrites: copy what you keep."""

    slots: list[int]
    starts: np.ndarray  # [B] int64 position of each request's first fed token
    counts: np.ndarray  # [B] int64
    row_start: np.ndarray  # [B] int64
    rows: torch.Tensor  # [>= sum(counts), len(capture_layers) * hidden] model dtype
# A padded CPU batch may hold at most this many times its real tokens, plus a few: past it the
# requests run as several forwards (``padding_groups``). The few spare a forward's fixed cost
# where the padding is small in tokens (decode rows beside verify rows).
MAX_PADDING_RATIO = 1.25
SPARE_PADDING_TOKENS = 32


def _fits(num_rows: int, width: int, num_tokens: int) -> bool:
    return num_rows * width <= MAX_PADDING_RATIO * num_tokens + SPARE_PADDING_TOKENS


def padding_groups(counts: np.ndarray) -> list[np.ndarray]:
    """The requests of a padded step (``counts`` [B] new tokens each) in groups whose padded
    size ``len(group) * max(count)`` stays within ``MAX_PADDING_RATIO`` of their tokens (plus
    ``SPARE_PADDING_TOKENS``): decodes together, a prefill chunk apart. One group when the whole
    step already does."""
    if counts.size < 2 or _fits(counts.size, int(counts.max()), int(counts.sum())):
        return [np.arange(counts.size)]
    groups, current, total = [], [], 0
    for b in np.argsort(counts, kind="stable").tolist():  # ascending: the widest row last
        n = int(counts[b])
        if current and not _fits(len(current) + 1, n, total + n):
            groups.append(np.array(current))
            current, total = [], 0
        current.append(b)
        total += n
    groups.append(np.array(current))
    return groups


@dataclass
class StepPenalties:
    """The penalties a captured step applies (``ops.apply_penalties``), one entry per request
    of the step in its order: ``slots[b]`` the request's row of the counts (-1: none here),
    ``params[b]`` its (repetition, frequency, presence). The runner sets ``applied`` when the
    step replayed a graph that applied them; otherwise they are still to be applied."""

    slots: np.ndarray  # [B] int64
    params: np.ndarray  # [B, 3] float32
    applied: bool = False


# bfloat16 CPU matmuls of this many rows or more run in float32 (prefill; see ops.cpu_linear).
# Decode and verify steps keep a bfloat16 matmul: widening the LM head every step costs more than
# it saves there. With the compiled bfloat16 kernel (Backend.cpu) the crossover is later
# (docs/benchmarks.md).
CPU_UPCAST_ROWS = 16
CPU_UPCAST_ROWS_WITH_KERNEL = 32
# The largest batch a token tree's verify replays a CUDA graph for (``capture_tree``): trees pay
# at small batches, and each bucket keeps the logits of every tree token.
TREE_GRAPH_MAX_BATCH = 8


class ModelRunner:
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

    def _init_flat(self, num_slots: int, max_step_tokens: int, kv_cache_dtype, enforce_eager: bool,
                   batch_invariant: bool) -> None:
        if self.device.type == "cuda" and self.config.head_dim < 16:
            raise ValueError(
                f"head_dim={self.config.head_dim}: the GPU attention kernel needs head_dim >= 16 "
                f"(tensor-core products of 16 features); run this model with device='cpu'")
        self.ops = self.backend.model_ops(batch_invariant)
        # Rows past max_model_len for the padding tokens of a fixed-shape step, and a scratch
        # slot for the padding rows of a bucket (kv_cache.KVCache; a hybrid's states too).
        self.kv_cache = make_cache(self.config, num_slots, self.max_model_len,
                                   kv_cache_dtype or self.dtype, self.device,
                                   extra_rows=max(1, max_step_tokens),
                                   max_step_tokens=max_step_tokens, **self._paging)
        cos, sin = rope_tables(self.config, self.max_model_len + self.kv_cache.extra_rows)
        self.cos = cos.to(self.device, self.dtype)  # [rows, head_dim]
        self.sin = sin.to(self.device, self.dtype)
        if not enforce_eager and num_slots > 0:
            self.graphs = CUDAGraphRunner(self.device, num_slots)

    # ----------------------------------------------------------------- flat layout (GPU)

    @staticmethod
    def graph_name(num_queries: int, num_layers: int | None = None) -> str:
        return f"forward_s{num_queries}" + ("" if num_layers is None else f"_l{num_layers}")

    @torch.inference_mode()
    def capture(self, query_counts, num_layers: int | None = None) -> None:
        """Capture the forward for every batch bucket and each number of new tokens per request
        in ``query_counts`` (1 = decode, k + 1 = verify); no-op without graphs."""
        if self.graphs is None:
            return
        for num_queries in sorted(set(query_counts)):
            if num_queries - 1 > self.kv_cache.extra_rows:
                raise ValueError(
                    f"cannot capture steps of {num_queries} tokens per request: the cache has "
                    f"{self.kv_cache.extra_rows} padding rows (max_step_tokens)")
            name = self.graph_name(num_queries, num_layers)
            if self.graphs.has(name):
                continue
            inputs = {"ids": StepInput(num_queries, torch.int64),
                      "slots": StepInput(1, torch.int64, self.kv_cache.scratch_slot),
                      "starts": StepInput(1, torch.int64, 0)}
            if self.hybrid:
                inputs["counts"] = StepInput(1, torch.int64, 1)
            if self.penalty_counts is not None and num_layers is None:
                inputs["penalty_slots"] = StepInput(1, torch.int64, -1)
                inputs["penalty_params"] = StepInput(3, torch.float32, 1.0)
            self.graphs.add(name, inputs, lambda x, s=num_queries: self._captured_step(
                x, s, num_layers))

    @staticmethod
    def tree_graph_name(num_tokens: int, max_depth: int) -> str:
        return f"tree_s{num_tokens}_d{max_depth}"

    @torch.inference_mode()
    def capture_tree(self) -> None:
        """Capture the verify forward over token trees of ``tree_graph`` = (tokens per request,
        the root included; static bound on a tree's depth) for the batch buckets up to
        ``TREE_GRAPH_MAX_BATCH`` (trees pay at small batches; each bucket keeps the logits of
        every tree token); no-op without graphs or ``tree_graph``."""
        if self.graphs is None or self.tree_graph is None:
            return
        num_tokens, max_depth = self.tree_graph
        name = self.tree_graph_name(num_tokens, max_depth)
        if self.graphs.has(name) or self.hybrid:
            return
        if num_tokens - 1 > self.kv_cache.extra_rows:
            raise ValueError(
                f"cannot capture trees of {num_tokens} tokens per request: the cache has "
                f"{self.kv_cache.extra_rows} padding rows (max_step_tokens)")
        inputs = {"ids": StepInput(num_tokens, torch.int64),
                  "slots": StepInput(1, torch.int64, self.kv_cache.scratch_slot),
                  "starts": StepInput(1, torch.int64, 0),
                  "depths": StepInput(num_tokens, torch.int64, 0),
                  # a padding request's paths: the root only (``_captured_step``)
                  "paths": StepInput(num_tokens * (max_depth + 1), torch.int32, -1)}
        self.graphs.add(name, inputs, lambda x: self._captured_step(x, num_tokens, None),
                        max_batch_size=TREE_GRAPH_MAX_BATCH)

    def _captured_step(self, x: dict[str, torch.Tensor], num_queries: int,
                       num_layers: int | None):
        """The body of a captured forward: [B * num_queries, V] float32 logits of every fed
        token, and with ``capture_layers`` the [B * num_queries, D] hidden states too."""
        depths = paths = None
        if "paths" in x:  # a token tree's verify (``capture_tree``)
            depths = x["depths"]
            paths = x["paths"].view(depths.numel(), -1)
            # every path starts at the root (slot 0): so do the padding requests' (-1 padded)
            paths = torch.cat([torch.zeros_like(paths[:, :1]), paths[:, 1:]], 1)
        batch = self.fixed_batch(x["slots"].view(-1), x["starts"].view(-1), num_queries,
                                 depths, paths)
        kwargs = {} if "counts" not in x else {"counts": x["counts"].view(-1)}
        if num_layers is None:
            kwargs.update(self._capture_kwargs())
        hidden, aux = self._split_captured(self.model.forward_flat(
            x["ids"].view(-1), batch, self.kv_cache.k_layers, self.kv_cache.v_layers,
            num_layers, **kwargs))
        logits = self.compute_logits(hidden)
        if "penalty_slots" in x:
            ops.apply_penalties(logits, x["ids"], x["penalty_slots"].view(-1),
                                x["penalty_params"], *self.penalty_counts)
        return logits if aux is None else (logits, aux)

    def fixed_batch(self, slot_ids: torch.Tensor, starts: torch.Tensor,
                    num_queries: int, depths: torch.Tensor | None = None,
                    tree_paths: torch.Tensor | None = None) -> FlatBatch:
        """The FlatBatch of B requests feeding ``num_queries`` tokens each, from device tensors
        (capturable): request b's tokens occupy cache rows ``starts[b] ..``, at those positions
        or, for token trees, at ``starts[b] + depths[b]`` ([B, num_queries]) with
        ``tree_paths`` ([B * num_queries, max_depth + 1], ``FlatBatch.tree_paths``)."""
        B = slot_ids.shape[0]
        offsets = torch.arange(num_queries, device=self.device)
        rows = starts[:, None] + offsets  # [B, num_queries]
        positions = rows if depths is None else starts[:, None] + depths
        tables = self.kv_cache.block_tables
        block_size = tables.block_size
        blocks = tables.table[slot_ids[:, None], rows // block_size].long()
        return FlatBatch(
            positions=positions.reshape(-1),
            slot_mapping=(blocks * block_size + rows % block_size).view(-1),
            slot_ids=slot_ids,
            context_lens=starts + num_queries,
            query_start=torch.arange(0, (B + 1) * num_queries, num_queries, device=self.device),
            max_queries=num_queries, cos=self.cos, sin=self.sin, ops=self.ops,
            block_tables=tables.table, tree_paths=tree_paths,
        )

    def fixed_step_hidden(self, input_ids: torch.Tensor, slot_ids: torch.Tensor,
                          starts: torch.Tensor, num_queries: int,
                          num_layers: int | None = None,
                          counts: torch.Tensor | None = None) -> torch.Tensor:
        """[B * num_queries, hidden] final-norm hidden states of every fed token (capturable;
        the cache's lengths are the caller's to advance). ``counts`` [B] (hybrids): each
        request's real tokens among its num_queries (None: all)."""
        batch = self.fixed_batch(slot_ids, starts, num_queries)
        kwargs = {} if counts is None else {"counts": counts}
        return self.model.forward_flat(input_ids, batch, self.kv_cache.k_layers,
                                       self.kv_cache.v_layers, num_layers, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, V] float32 through the LM head."""
        return self.model.compute_logits(hidden, self.ops if self.flat else None)

    def _graph_for(self, batch_size: int, width: int, num_layers: int | None) -> int | None:
        """The smallest captured number of tokens per request >= width that fits the batch."""
        if self.graphs is None:
            return None
        for num_queries in range(width, self.kv_cache.extra_rows + 2):
            if self.graphs.fits(self.graph_name(num_queries, num_layers), batch_size):
                return num_queries
        return None

    def _tree_graph_for(self, batch_size: int, width: int, tree: TreeFeed,
                        num_layers: int | None) -> tuple[int | None, str | None]:
        """(tokens per request, graph name) of the captured tree verify that holds this
        forward: the whole tree of every request (first slot 0), all layers, a tree no deeper
        and no wider than captured, a batch that fits; else (None, None): eager."""
        if self.graphs is None or self.tree_graph is None or num_layers is not None:
            return None, None
        num_tokens, max_depth = self.tree_graph
        name = self.tree_graph_name(num_tokens, max_depth)
        if (tree.first_slot != 0 or tree.max_depth > max_depth or width > num_tokens
                or not self.graphs.fits(name, batch_size)):
            return None, None
        return num_tokens, name

    def _forward_flat(self, slots: list[int], counts: np.ndarray, ids: np.ndarray,
                      scatter: tuple[np.ndarray, torch.Tensor] | None, logits: str,
                      num_layers: int | None,
                      penalties: StepPenalties | None = None,
                      tree: TreeFeed | None = None) -> torch.Tensor | None:
        """The flat-layout forward: ``ids`` [B, width] host (row b's first counts[b] are real),
        ``scatter`` = (flat indices into it, device token ids) overwrites some of them on the
        device (drafts that never visit the host). A token tree's verify (``tree``) replays
        the captured tree step where one holds it (``capture_tree``), else runs eagerly."""
        cache = self.kv_cache
        cache.block_tables.sync()
        B, width = ids.shape
        starts = cache.lengths_np[slots]
        if tree is None:
            num_queries = self._graph_for(B, width, num_layers)
            graph = None if num_queries is None else self.graph_name(num_queries, num_layers)
        else:
            num_queries, graph = self._tree_graph_for(B, width, tree, num_layers)
        if num_queries is not None:  # replay: every request padded to num_queries tokens
            if num_queries > width:
                ids = np.pad(ids, ((0, 0), (0, num_queries - width)))
            ids_in = ids
            if scatter is not None:
                index = scatter[0] // width * num_queries + scatter[0] % width
                ids_in = to_device(ids, self.device)
                ids_in.view(-1)[to_device(index, self.device)] = scatter[1]
            slots_np = np.asarray(slots, dtype=np.int64)[:, None]
            rows = {"ids": ids_in, "slots": slots_np, "starts": starts[:, None]}
            if self.hybrid:
                rows["counts"] = counts[:, None]
            if tree is not None:
                tree.check_rows(starts)
                rows["depths"], paths = tree.padded(counts, num_queries, self.tree_graph[1])
                rows["paths"] = paths.reshape(B, -1)
            if self.graphs.takes(graph, "penalty_slots"):
                if penalties is None:
                    rows["penalty_slots"] = np.full((B, 1), -1, dtype=np.int64)
                    rows["penalty_params"] = np.ones((B, 3), dtype=np.float32)
                else:
                    rows["penalty_slots"] = penalties.slots[:, None]
                    rows["penalty_params"] = penalties.params
                    penalties.applied = True
            outputs, _ = self.graphs.run(graph, rows)
            row_start = np.arange(B) * num_queries
            all_logits = outputs
            if isinstance(outputs, tuple):  # the hidden states capture_layers names
                all_logits = outputs[0]
                self.captured_hidden = CapturedHidden(list(slots), starts.copy(), counts.copy(),
                                                      row_start, outputs[1])
        else:  # eager, no padding: T = sum(counts) tokens
            valid = np.arange(width)[None, :] < counts[:, None]
            flat_ids = to_device(ids[valid], self.device)
            if scatter is not None:
                index = np.cumsum(valid.reshape(-1)) - 1  # padded flat index -> flat index
                flat_ids[to_device(index[scatter[0]], self.device)] = scatter[1]
            batch = self.flat_batch(slots, counts, starts, tree)
            hidden = self._capture(slots, starts, counts, None, self.model.forward_flat(
                flat_ids, batch, cache.k_layers, cache.v_layers, num_layers,
                **self._capture_kwargs()))
            all_logits, row_start = None, np.cumsum(counts) - counts
        cache.advance(slots, counts.tolist())
        if logits == "none":
            return None
        if logits == "last":
            rows = row_start + counts - 1
        else:
            rows = np.concatenate([s + np.arange(n) for s, n in zip(row_start, counts)])
        contiguous = rows[-1] - rows[0] == rows.size - 1  # rows are increasing
        if all_logits is None:
            hidden = hidden[rows[0]:rows[-1] + 1] if contiguous else hidden[
                to_device(rows, self.device)]
            return self.model.compute_logits(hidden, self.ops)
        if contiguous:
            return all_logits[rows[0]:rows[-1] + 1]
        return all_logits[to_device(rows, self.device)]

    def flat_batch(self, slots: list[int], counts: np.ndarray, starts: np.ndarray,
                   tree: TreeFeed | None = None) -> FlatBatch:
        """The FlatBatch of an eager flat step (no padding): slot ``slots[b]`` feeds
        ``counts[b]`` tokens from position ``starts[b]`` (host arrays); with ``tree``, tree
        slots at the cache rows from ``starts[b]``, each at its position by depth."""
        query_start = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        offsets = np.arange(int(counts.max()))
        rows = (starts[:, None] + offsets)[offsets < counts[:, None]]
        tables = self.kv_cache.block_tables
        slot_mapping = tables.slot_mapping(
            np.repeat(np.asarray(slots, dtype=np.int64), counts), rows)

        def dev(a) -> torch.Tensor:
            return to_device(np.ascontiguousarray(a, dtype=np.int64), self.device)

        positions, tree_paths = rows, None
        if tree is not None:
            tree.check_rows(starts)
            positions, paths = tree.flat(counts)
            tree_paths = to_device(paths, self.device)
        return FlatBatch(dev(positions), dev(slot_mapping), dev(slots), dev(starts + counts),
                         dev(query_start), int(counts.max()), self.cos, self.sin, self.ops,
                         tables.table, tree_paths)

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
        index = np.concatenate([b * width + 1 + np.arange(n - 1) for b, n in enumerate(counts)])
        return self._forward_flat(slots, counts, ids, (index, draft_token_ids), "all", None,
                                  penalties)

    def _metadata(
        self, slots: list[int], counts: np.ndarray, starts: np.ndarray, width: int,
        tree: TreeFeed | None = None,
    ) -> tuple[AttentionMetadata, np.ndarray, np.ndarray | None]:
        """AttentionMetadata for a padded [B, width] batch; also the [B, width] cache rows and
        the flat indices of valid tokens (None when there is no padding). With ``tree`` the
        tokens are tree slots: positions by depth, the tree's attention mask."""
        B = len(slots)
        positions = starts[:, None] + np.arange(width)[None, :]  # [B, width]
        valid = np.arange(width)[None, :] < counts[:, None]
        valid_index = None if valid.all() else np.flatnonzero(valid)
        slots_np = np.repeat(np.asarray(slots, dtype=np.int64), width)
        write_positions = positions.reshape(-1)
        if valid_index is not None:
            slots_np, write_positions = slots_np[valid_index], write_positions[valid_index]
        kv_len = int((starts + counts).max())

        rope_positions = torch.from_numpy(np.minimum(positions, self.max_model_len - 1))
        rope_positions = rope_positions.to(self.device)
        attn_mask, is_causal = None, False
        window = self.config.sliding_window
        windowed = window is not None and kv_len > window
        if tree is not None:  # tree slots: positions by depth, the context and the ancestors
            tree.check_rows(starts)
            tree_positions, attn_mask = tree.attention(width, kv_len, window)
            rope_positions = tree_positions.clamp_max(self.max_model_len - 1).to(self.device)
            attn_mask = attn_mask.to(self.device)
        elif B == 1 and width == 1 and not windowed:
            pass  # one query that sees every live row
        elif B == 1 and starts[0] == 0 and not windowed:
            is_causal = True  # prefill from an empty slot: width == kv_len
        elif width == 1 and (starts == starts[0]).all() and not windowed:
            pass  # decode of equal-length requests: every row sees every live row
        else:
            keys = self._key_positions[:kv_len]
            query_pos = torch.from_numpy(positions).to(self.device)[:, :, None]  # [B, width, 1]
            # Causal over absolute positions: the query at position p sees keys 0..p (padding
            # queries see rows past their request's length; their outputs are discarded).
            attn_mask = keys <= query_pos
            if window is not None:
                attn_mask &= query_pos - keys < window
            attn_mask = attn_mask[:, None]  # [B, 1, width, kv_len]
        tables = self.kv_cache.block_tables
        num_blocks = -(-kv_len // tables.block_size)
        meta = AttentionMetadata(
            cos=self.cos[rope_positions].unsqueeze(2),
            sin=self.sin[rope_positions].unsqueeze(2),
            write_slots=torch.from_numpy(slots_np).to(self.device),
            write_positions=torch.from_numpy(write_positions).to(self.device),
            slot_mapping=torch.from_numpy(tables.slot_mapping(slots_np, write_positions)).to(
                self.device),
            valid_index=None if valid_index is None
            else torch.from_numpy(valid_index).to(self.device),
            block_tables=torch.from_numpy(np.ascontiguousarray(
                tables.table_np[slots, :num_blocks])).to(self.device),
            kv_len=kv_len,
            attn_mask=attn_mask,
            is_causal=is_causal,
        )
        return meta, positions, valid_index

    @torch.inference_mode()
    def forward(
        self,
        slots: list[int],
        token_ids: list[list[int]],
        logits: str = "last",
        num_layers: int | None = None,
        penalties: StepPenalties | None = None,
        tree: TreeFeed | None = None,
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

        Each slot's committed length grows by ``len(token_ids[i])``; roll back with
        ``self.kv_cache.truncate``.
        """
        if logits not in LOGITS_MODES:
            raise ValueError(f"logits must be one of {LOGITS_MODES}, got {logits!r}")
        cache = self.kv_cache
        counts = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=len(token_ids))
        limit = self.max_forward_tokens
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
            return self._forward_flat(slots, counts, ids_np, None, logits, num_layers,
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
                rows = rows[meta.valid_index]
        return self.model.compute_logits(rows)

    def graph_output_bytes(self, query_counts) -> int:
        """Device memory the outputs of ``capture(query_counts)`` will hold: every batch bucket
        keeps its own float32 logits of every fed token (and the hidden states
        ``capture_layers`` names); 0 without graphs. The memory plan leaves it out of the
        KV pool (at 256 slots and a 128 k vocabulary: 2.2 GB for decode, 4x that for a verify
        of 4 tokens a request)."""
        if self.graphs is None or not self.graphs.capture_graphs:
            return 0
        per_row = self.config.vocab_size * 4 + len(self.capture_layers) * (
            self.config.hidden_size * self.dtype.itemsize)
        rows = sum(self.graphs.buckets) * sum(set(query_counts))
        if self.tree_graph is not None and not self.hybrid:
            top = bucket_for(TREE_GRAPH_MAX_BATCH, self.graphs.buckets) or self.graphs.buckets[-1]
            rows += sum(b for b in self.graphs.buckets if b <= top) * self.tree_graph[0]
        return rows * per_row

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
        scratch = torch.tensor([self.kv_cache.block_tables.scratch_slot], device=self.device)
        counts = np.array([min(num_tokens, self.max_model_len)], dtype=np.int64)
        if self.flat:
            batch = self.flat_batch([int(scratch)], counts, np.zeros(1, dtype=np.int64))
            kwargs = {"counts": torch.tensor(counts, device=self.device)} if self.hybrid else {}
            ids = torch.zeros(int(counts[0]), dtype=torch.int64, device=self.device)
            hidden = self.model.forward_flat(ids, batch, self.kv_cache.k_layers,
                                             self.kv_cache.v_layers, None, **kwargs)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
            del ids, batch
            rows = hidden[-1:].expand(num_logit_rows, -1).contiguous()
            del hidden
            logits = self.compute_logits(rows)
            probs = torch.softmax(logits, dim=-1)
            del rows, logits, probs
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        return int(peak * 1.05) + (64 << 20)  # headroom for allocator fragmentation

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

    def _forward_grouped(self, slots: list[int], token_ids: list[list[int]], counts: np.ndarray,
                         groups: list[np.ndarray], logits: str,
                         num_layers: int | None) -> torch.Tensor | None:
        """``forward`` of requests whose new-token counts differ widely (decodes beside a
        prefill chunk) as one padded forward per group of similar counts (``padding_groups``),
        so the padded batch does not multiply the work. Batch invariance makes the logits, the
        cache and the captured hidden states those of one forward."""
        starts = self.kv_cache.lengths_np[slots].copy()
        outputs: list[torch.Tensor | None] = [None] * len(slots)
        captured: list[torch.Tensor | None] = [None] * len(slots)
        for group in groups:
            out = self.forward([slots[b] for b in group], [token_ids[b] for b in group],
                               logits, num_layers)
            kept = self.captured_hidden
            row = 0
            for i, b in enumerate(group.tolist()):
                n = int(counts[b])
                if out is not None:
                    outputs[b] = out[i:i + 1] if logits == "last" else out[row:row + n]
                if self.capture_layers and kept is not None:
                    start = int(kept.row_start[i])
                    captured[b] = kept.rows[start:start + n]
                row += n
        if self.capture_layers:
            self.captured_hidden = CapturedHidden(list(slots), starts, counts.copy(),
                                                  np.cumsum(counts) - counts,
                                                  torch.cat(captured))
        if logits == "none":
            return None
        return torch.cat(outputs)

    def _capture_kwargs(self) -> dict:
        """The model's ``capture_layers`` argument: the listed layers below the final norm."""
        inner = tuple(i for i in self.capture_layers if i < self.config.num_hidden_layers)
        return {"capture_layers": inner} if inner else {}

    def _split_captured(self, output) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A forward's output -> (final-norm hidden states, the hidden states
        ``capture_layers`` names side by side [..., D], or None without them)."""
        hidden, captured = output if isinstance(output, tuple) else (output, [])
        if not self.capture_layers:
            return hidden, None
        captured = iter(captured)
        parts = [hidden if i >= self.config.num_hidden_layers else next(captured)
                 for i in self.capture_layers]
        return hidden, torch.cat(parts, dim=-1).reshape(-1, sum(p.shape[-1] for p in parts))

    def _capture(self, slots: list[int], starts: np.ndarray, counts: np.ndarray,
                 valid_index: torch.Tensor | None, output) -> torch.Tensor:
        """Keep the hidden states ``capture_layers`` names in ``captured_hidden`` (the rows of
        the valid tokens); returns the final-norm hidden states."""
        hidden, rows = self._split_captured(output)
        if rows is None:
            return hidden
        if valid_index is not None:
            rows = rows[valid_index]
        counts = np.asarray(counts).copy()
        self.captured_hidden = CapturedHidden(list(slots), np.asarray(starts).copy(), counts,
                                              np.cumsum(counts) - counts, rows)
        return hidden
