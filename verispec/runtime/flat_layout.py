"""The GPU path's flat token layout and its CUDA graphs (``verispec.runtime.model_runner``'s
docstring describes both): ``LlamaForCausalLM.forward_flat`` over a ``FlatBatch`` of a step's
new tokens, eager or replayed from the graphs ``capture`` (chains: decode, verify) and
``capture_tree`` (token trees' verify) record, and the penalties a captured step applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verispec import ops
from verispec.models.layout import FlatBatch
from verispec.models.rope import rope_tables
from verispec.ops import to_device
from verispec.ops.tree_feed import TreeFeed
from verispec.runtime.cuda_graphs import CUDAGraphRunner, StepInput, bucket_for
from verispec.runtime.hidden_capture import CapturedHidden
from verispec.runtime.state_cache import make_cache


def ragged_arange(counts: np.ndarray) -> np.ndarray:
    """0 .. counts[b] - 1 for each b, concatenated: [sum(counts)] int64 (the rows of a step's
    requests within their runs, without a NumPy call per request)."""
    counts = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(int(ends[-1]) if ends.size else 0) - np.repeat(ends - counts, counts)


@dataclass
class StepPenalties:
    """The penalties a captured step applies (``ops.apply_penalties``), one entry per request
    of the step in its order: ``slots[b]`` the request's row of the counts (-1: none here),
    ``params[b]`` its (repetition, frequency, presence). The runner sets ``applied`` when the
    step replayed a graph that applied them; otherwise they are still to be applied."""

    slots: np.ndarray  # [B] int64
    params: np.ndarray  # [B, 3] float32
    applied: bool = False


# The largest batch a token tree's verify replays a CUDA graph for (``capture_tree``): trees pay
# at small batches, and each bucket keeps the logits of every tree token.
TREE_GRAPH_MAX_BATCH = 8


class FlatLayout:
    """The ``ModelRunner`` methods of the flat layout (they read the attributes its
    ``__init__`` sets and call its ``compute_logits`` and hidden-state methods)."""

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
            rows = np.repeat(row_start, counts) + ragged_arange(counts)
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
