"""Which generator states a resuming rank restores (train/trainer.rng_state_for)."""

from slipstream.train.trainer import rng_state_for

STATE = {"rng": "rank0", "rng_per_rank": ["rank0", "rank1", "rank2", "rank3"], "rng_layout": [2, 1, 1]}


def test_same_ranks_and_layout_restore_each_ranks_own_states():
    assert [rng_state_for(STATE, r, 4, [2, 1, 1]) for r in range(4)] == ["rank0", "rank1", "rank2", "rank3"]


def test_a_new_tp_or_cp_layout_at_the_same_world_size_gives_every_rank_rank0s():
    """Saved at tp2 x dp2 (ranks 0,1 and 2,3 held equal states), resumed at tp4: one tp group
    would hold two different states and draw different dropout masks on replicated activations."""
    assert {rng_state_for(STATE, r, 4, [4, 1, 1]) for r in range(4)} == {"rank0"}
    assert {rng_state_for(STATE, r, 4, [2, 2, 1]) for r in range(4)} == {"rank0"}


def test_another_world_size_or_a_single_process_checkpoint_gives_rank0s():
    assert {rng_state_for(STATE, r, 2, [2, 1, 1]) for r in range(2)} == {"rank0"}
    assert rng_state_for({"rng": "only", "rng_per_rank": None}, 0, 1, [1, 1, 1]) == "only"


def test_checkpoints_from_before_the_layout_was_recorded_keep_the_world_size_rule():
    old = {k: v for k, v in STATE.items() if k != "rng_layout"}
    assert rng_state_for(old, 3, 4, [4, 1, 1]) == "rank3"
