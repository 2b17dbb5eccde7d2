"""The synthetic tasks: answers and ground-truth positions checked against a plain-Python reading."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace.train.tasks import (
    EVAL_STREAM,
    IGNORE,
    TRAIN_STREAM,
    RelationsTask,
    ReverseTask,
    batch_generator,
    make_task,
)


def _relations_by_hand(task: RelationsTask, seq: list[int]) -> tuple[list[int], list[list[int]]]:
    """Targets and relation positions of one sequence, computed one position at a time."""
    K, V = task.n_types, task.n_values
    targets, positions = [], []
    for i, tok in enumerate(seq):
        if i < K:
            targets.append(IGNORE)
            positions.append([-1, -1])
            continue
        prev_value = seq[i - 1] % V
        t = tok // V
        slot = [k for k in range(K) if seq[k] // V == t]
        assert len(slot) == 1  # every type is in the memory exactly once
        match_value = seq[slot[0]] % V
        targets.append(task.answer_base + prev_value * V + match_value)
        positions.append([i - 1, slot[0]])
    return targets, positions


@settings(max_examples=15, deadline=None)
@given(
    n_types=st.integers(2, 7),
    n_values=st.integers(2, 11),
    n_stream=st.integers(1, 13),
    batch=st.integers(1, 5),
    seed=st.integers(0, 10_000),
)
def test_relations_targets_and_ground_truth_match_a_plain_reading(
    n_types: int, n_values: int, n_stream: int, batch: int, seed: int
) -> None:
    task = RelationsTask(n_types=n_types, n_values=n_values, n_stream=n_stream)
    b = task.sample(batch_generator(seed, 3), batch)
    S = n_types + n_stream
    assert b.tokens.shape == (batch, S) and b.targets.shape == (batch, S)
    assert b.relation_pos is not None and b.relation_pos.shape == (batch, S, 2)
    assert int(b.tokens.max()) < task.answer_base  # inputs are items only
    for row in range(batch):
        seq = b.tokens[row].tolist()
        # the memory holds every type once
        assert sorted(t // n_values for t in seq[:n_types]) == list(range(n_types))
        targets, positions = _relations_by_hand(task, seq)
        assert b.targets[row].tolist() == targets
        assert b.relation_pos[row].tolist() == positions


def test_relations_parts_split_answers_and_reject_non_answers() -> None:
    task = RelationsTask(n_types=3, n_values=5, n_stream=2)
    answers = torch.tensor([task.answer_base + 2 * 5 + 4, task.answer_base, 7])  # (2,4), (0,0), an item
    assert task.parts(answers).tolist() == [[2, 4], [0, 0], [-1, -1]]
    assert task.token_name(task.answer_base + 2 * 5 + 4) == "(2,4)"
    assert task.token_name(7) == "1:2"
    with pytest.raises(ValueError, match="token must be in"):
        task.token_name(task.vocab_size)


def test_batches_depend_only_on_seed_step_and_stream() -> None:
    task = RelationsTask()
    a = task.sample(batch_generator(5, 17), 11)
    torch.manual_seed(123)  # the global RNG plays no part
    b = task.sample(batch_generator(5, 17), 11)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.tokens, task.sample(batch_generator(5, 18), 11).tokens)
    assert not torch.equal(a.tokens, task.sample(batch_generator(6, 17), 11).tokens)
    assert not torch.equal(
        task.sample(batch_generator(5, 0, TRAIN_STREAM), 11).tokens,
        task.sample(batch_generator(5, 0, EVAL_STREAM), 11).tokens,
    )


def test_batch_rows_are_a_slice_of_every_field() -> None:
    b = RelationsTask().sample(batch_generator(0, 0), 6)
    part = b.rows(2, 5)
    assert torch.equal(part.tokens, b.tokens[2:5])
    assert torch.equal(part.targets, b.targets[2:5])
    assert part.relation_pos is not None and torch.equal(part.relation_pos, b.relation_pos[2:5])


def test_reverse_task_mirrors() -> None:
    task = ReverseTask(n_symbols=7, length=5)
    b = task.sample(batch_generator(1, 2), 3)
    assert b.tokens.shape == (3, 11)
    for row in range(3):
        seq = b.tokens[row].tolist()
        assert seq[5] == task.sep_id
        assert seq[6:] == seq[:5][::-1]
        for i in range(5, 10):  # position i predicts the token at i + 1, which copies position 9 - i
            assert b.targets[row, i] == seq[i + 1]
            assert b.relation_pos is not None and b.relation_pos[row, i, 0] == 9 - i
            assert seq[9 - i] == seq[i + 1]
        assert (b.targets[row, :5] == IGNORE).all() and b.targets[row, 10] == IGNORE


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        ({"n_types": 1}, ValueError, "n_types must be in [2, 64]; got 1"),
        ({"n_values": 1000}, ValueError, "n_values must be in [2, 64]; got 1000"),
        ({"n_stream": 0}, ValueError, "n_stream must be in [1, 1024]; got 0"),
        ({"n_types": 2.5}, TypeError, "n_types must be an int; got float 2.5"),
    ],
)
def test_relations_options_out_of_range(kwargs: dict, exc: type, words: str) -> None:
    with pytest.raises(exc) as info:
        RelationsTask(**kwargs)
    assert words in str(info.value)


def test_bad_task_name_and_generator_arguments() -> None:
    with pytest.raises(ValueError, match=r"task must be one of relations, reverse; got 'copy'"):
        make_task("copy")
    with pytest.raises(ValueError, match="step must be a non-negative int; got -1"):
        batch_generator(0, -1)
    with pytest.raises(ValueError, match="batch_size must be >= 1; got 0"):
        RelationsTask().sample(batch_generator(0, 0), 0)


def test_step_seed_depends_on_seed_step_and_stream_only():
    from headspace.train.tasks import DROPOUT_STREAM, step_seed

    assert step_seed(3, 10, DROPOUT_STREAM) == step_seed(3, 10, DROPOUT_STREAM)
    seeds = {step_seed(3, s, DROPOUT_STREAM + r) for s in range(20) for r in range(4)}
    assert len(seeds) == 80  # every (step, rank) gets its own dropout stream
    assert step_seed(3, 10, 0) != step_seed(4, 10, 0)
