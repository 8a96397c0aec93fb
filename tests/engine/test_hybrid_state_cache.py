"""``HybridCache``: which lengths a slot's recurrent state ring holds, and what it refuses.

Strategy: the bookkeeping alone, on a config without weights: a slot fed through the recurrent
form keeps its last ``max_step_tokens + 1`` lengths, a chunked-scan feed only its last; truncating
to a length still held is allowed (the rollback), below it a ValueError naming the slot and the
lengths held; ``free`` forgets everything. The K/V cover only the attention layers, and the
bytes of the states are what the shapes say. A hybrid on the flat (GPU) layout is refused.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.test_granite_hybrid import (
    one_thread,  # noqa: F401 (autouse fixture)
    save_hybrid,
)
from verispec.models.config import HybridModelConfig
from verispec.models.loader import load_model
from verispec.models.mamba2 import MAX_RECURRENT_TOKENS
from verispec.runtime.model_runner import ModelRunner
from verispec.runtime.state_cache import HybridCache, make_cache

HF_CONFIG = {
    "vocab_size": 16, "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "shared_intermediate_size": 48, "num_local_experts": 0,
    "layer_types": ["mamba", "attention", "mamba", "mamba"], "mamba_n_heads": 4,
    "mamba_d_state": 8, "mamba_n_groups": 2, "mamba_d_conv": 4, "mamba_expand": 2,
}


def cache(max_step_tokens: int = 2, num_slots: int = 2) -> HybridCache:
    config = HybridModelConfig.from_hf_dict(HF_CONFIG, "GraniteMoeHybridForCausalLM")
    made = make_cache(config, num_slots, 128, torch.float32, max_step_tokens=max_step_tokens)
    assert isinstance(made, HybridCache)
    return made


def test_recurrent_feeds_keep_the_last_ring_lengths():
    c = cache(max_step_tokens=2)  # ring of 3 lengths
    c.advance([0], [5])  # a short prompt: recurrent, keeps 3..5
    assert c.state_start_np[0] == 3
    c.truncate(0, 3)
    c.advance([0], [2])  # a verify step 3 -> 5: 3..5 again
    c.truncate(0, 4)  # one token accepted
    c.advance([0], [1])
    assert c.state_start_np[0] == 3 and c.length(0) == 5
    with pytest.raises(ValueError, match=r"cannot truncate slot 0 to 2: .* lengths 3\.\.5"):
        c.truncate(0, 2)
    assert c.length(0) == 5  # a refused truncation changes nothing
    c.advance([0], [2])  # 5 -> 7: keeps 5..7
    with pytest.raises(ValueError, match="lengths 5..7"):
        c.truncate(0, 4)


def test_chunked_feed_keeps_its_last_two_lengths():
    """The chunked scan covers all but the last token, which takes the recurrent form: the
    states after the last two tokens are kept (a captured draft re-feeds the last one)."""
    c = cache(max_step_tokens=4)
    n = MAX_RECURRENT_TOKENS + 1
    c.advance([1], [n])
    assert c.state_start_np[1] == n - 1
    c.truncate(1, n)  # no-op: allowed
    c.truncate(1, n - 1)
    with pytest.raises(ValueError, match=f"slot 1 to {n - 2}"):
        c.truncate(1, n - 2)
    c.truncate(1, 0)  # an empty slot starts from zero states: always allowed
    assert c.state_start_np[1] == 0
    c.advance([1], [n])
    c.free(1)
    assert c.length(1) == 0 and c.state_start_np[1] == 0


def test_memory_covers_attention_kv_and_every_state_position():
    c = cache(max_step_tokens=3, num_slots=2)
    # one attention layer, paged: 2 slots x 128 positions in blocks of 16, + the scratch block
    assert c.k.shape == (1, 2 * 8 + 1, 16, 2, 8)
    assert len(c.states) == 3 and len(c.k_layers) == 4
    conv_dim = 2 * 32 + 2 * 2 * 8
    per_layer = 2 * 4 * 4 * (conv_dim * 3 + 4 * 16 * 8)  # slots x ring x float32 x (conv + ssm)
    assert c.state_nbytes == 3 * per_layer
    assert c.nbytes == 2 * c.k.numel() * 4 + c.state_nbytes


def test_flat_layout_cache_has_a_scratch_slot_for_states_too(tmp_path):
    model = load_model(save_hybrid(tmp_path)).model
    runner = ModelRunner(model, 2, 64, flat_layout=True, max_step_tokens=4)
    c = runner.kv_cache
    assert isinstance(c, HybridCache) and c.scratch_slot == 2 and c.ring_size == 5
    # blocks for 2 slots of 64 positions + 4 padding positions each, + the scratch block
    assert c.k.shape[1:3] == (2 * 5 + 1, 16) and c.block_tables.table_np.shape == (3, 5)
    assert all(s.conv.shape[:2] == (3, 5) and s.scratch_slot == 2 for s in c.states)
    assert c.position_nbytes * 3 * 5 == c.state_nbytes
