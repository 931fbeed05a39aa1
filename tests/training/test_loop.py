"""The training loop: window sampling, checkpoints and exact resume, DDP with gloo, evaluation report."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.errors import TrainingError
from chatapp.stt import STTForCausalLM
from chatapp.training.evaluation import evaluate
from chatapp.training.loop import DistInfo, TokenStream, TrainConfig, WindowSampler, latest_checkpoint, train
from tests.stt.conftest import tiny_config

REPO = Path(__file__).resolve().parents[2]


def stream(n: int = 400, seed: int = 0) -> TokenStream:
    g = torch.Generator().manual_seed(seed)
    return TokenStream(torch.randint(0, 300, (n,), generator=g), torch.rand(n, generator=g) < 0.7)


def fresh_model() -> STTForCausalLM:
    torch.manual_seed(0)
    return STTForCausalLM(tiny_config())


def test_sampler_shards_ranks_and_covers_each_epoch():
    samplers = [WindowSampler(12, 3, seed=1, dist_info=DistInfo(rank=r, world_size=2)) for r in range(2)]
    seen = [torch.cat([s.indices(step) for s in samplers]) for step in range(2)]
    epoch = torch.cat(seen)
    assert sorted(epoch.tolist()) == list(range(12))  # 2 steps x 2 ranks x 3 = one epoch, no window twice
    assert torch.equal(samplers[0].indices(5), WindowSampler(12, 3, 1, DistInfo(0, 2)).indices(5))


def test_token_stream_windows_and_batches():
    data = TokenStream.from_sequences([([1, 2, 3], [0, 1, 1]), ([4, 5, 6, 7], [0, 0, 1, 1])])
    ids, mask = data.windows(torch.tensor([1, 0]), 3)
    assert ids.tolist() == [[4, 5, 6], [1, 2, 3]]
    assert mask.tolist() == [[False, False, True], [False, True, True]]
    assert [b[0].shape[0] for b in data.batches(1, 3)] == [1, 1]


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30), seq_len=st.integers(2, 24))
def test_windows_start_at_sequences_and_hold_each_short_one_whole(lengths, seq_len):
    """Oracle: brute force over the stream. Every window begins where a sequence begins (or goes on inside one
    longer than a window), every sequence that fits a window lies whole in one, and no stretch of a window's
    length is left out of every window."""
    sequences = [([100 * i + j for j in range(n)], [j % 2 for j in range(n)]) for i, n in enumerate(lengths)]
    data = TokenStream.from_sequences(sequences)
    ids = data.ids.tolist()
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    offsets = data.window_offsets(seq_len).tolist()
    assert offsets == sorted(set(offsets)) and all(o + seq_len <= len(ids) for o in offsets)
    assert data.num_windows(seq_len) == len(offsets) >= (1 if len(ids) >= seq_len else 0)
    for offset in offsets:
        owner = max(s for s in starts if s <= offset)
        assert offset == owner or offset - owner >= seq_len  # inside a sequence only when it is longer than a window
    covered = [False] * len(ids)
    for offset in offsets:
        covered[offset : offset + seq_len] = [True] * seq_len
    for start, n in zip(starts, lengths, strict=True):
        if n <= seq_len and start + seq_len <= len(ids):
            assert any(o <= start and start + n <= o + seq_len for o in offsets), (start, n)
    last_window_end = max((o + seq_len for o in offsets), default=0)
    assert all(covered[:last_window_end]) and len(ids) - last_window_end < seq_len + max(lengths)
    if offsets:
        window_ids, window_mask = data.windows(torch.arange(len(offsets)), seq_len)
        assert window_ids.tolist() == [ids[o : o + seq_len] for o in offsets]
        assert window_mask.tolist() == [[bool(m) for m in data.loss_mask.tolist()[o : o + seq_len]] for o in offsets]


def test_stream_without_sequence_starts_is_cut_at_multiples_of_the_window():
    data = stream(100)
    assert data.window_offsets(30).tolist() == [0, 30, 60]
    assert torch.equal(data.windows(torch.tensor([2]), 30)[0][0], data.ids[60:90])


def test_training_checkpoints_and_resumes_exactly(tmp_path):
    config = TrainConfig(steps=4, batch_size=2, seq_len=16, lr_scale=100.0, checkpoint_interval=2, eval_batches=1)
    straight = fresh_model()
    train(straight, stream(), config, out_dir=tmp_path / "straight")

    class Interrupted(Exception):
        pass

    def crash_after_step_3(report) -> None:
        if report.step == 3:
            raise Interrupted

    with pytest.raises(Interrupted):
        train(fresh_model(), stream(), config, out_dir=tmp_path / "resumed", on_step=crash_after_step_3)
    checkpoint = latest_checkpoint(tmp_path / "resumed")
    assert checkpoint is not None and checkpoint.name == "step_000002"
    resumed = fresh_model()
    reports = []
    train(resumed, stream(), config, out_dir=tmp_path / "resumed", resume=True, on_step=reports.append)
    assert [r.step for r in reports] == [3, 4]
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    saved = STTForCausalLM.from_pretrained(tmp_path / "resumed")
    assert saved.config.routing_trained is True
    torch.testing.assert_close(saved.lm_head.weight, straight.lm_head.weight)


def test_reports_carry_losses_throughput_selection_and_periodic_eval():
    reports = []
    config = TrainConfig(steps=2, batch_size=2, seq_len=16, eval_interval=1, eval_batches=1)
    train(fresh_model(), stream(), config, eval_data=stream(seed=1), on_step=reports.append)
    assert [r.step for r in reports] == [1, 2]
    last = reports[-1]
    assert set(last.losses) == {"lm", "tpn", "causal", "g_reg", "total"}
    assert last.tokens_per_s > 0 and len(last.teacher_fraction) == 2
    assert last.eval is not None and set(last.eval.perplexity) == {"off", "teacher", "student"}


def test_corpus_smaller_than_a_window_is_a_training_error():
    with pytest.raises(TrainingError, match="fewer than one window"):
        train(fresh_model(), stream(10), TrainConfig(steps=1, seq_len=16))


def test_evaluation_report_agrees_with_a_direct_computation():
    model = fresh_model()
    data = stream(64)
    batches = list(data.batches(2, 16))
    report = evaluate(model, batches)
    losses, weights = [], []
    for ids, mask in batches:
        logits = model.forward_eval(ids, "off").logits
        token_losses = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none"
        )
        losses.append(token_losses * mask[:, 1:].flatten())
        weights.append(mask[:, 1:].sum())
    assert report.loss["off"] == pytest.approx((torch.cat(losses).sum() / sum(weights)).item(), rel=1e-5)
    assert report.selected_fraction["off"] == [1.0, 1.0]
    assert all(0 <= f <= 1 for f in report.student_f1)
    assert 0 <= report.compute_saved("student") <= 1


DDP_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch
    import torch.distributed as dist
    sys.path.insert(0, {repo!r})
    from tests.stt.conftest import tiny_config
    from chatapp.stt import STTForCausalLM
    from chatapp.training.loop import TokenStream, TrainConfig, init_distributed, train

    info = init_distributed()
    torch.manual_seed(0)
    model = STTForCausalLM(tiny_config())
    g = torch.Generator().manual_seed(0)
    data = TokenStream(torch.randint(0, 300, (600,), generator=g), torch.ones(600, dtype=torch.bool))
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    train(model, data, TrainConfig(steps=3, batch_size=2, seq_len=16, lr_scale=100.0), dist_info=info)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.save({{"before": before, "after": after}}, os.path.join({out!r}, f"rank{{info.rank}}.pt"))
    dist.destroy_process_group()
    """
)


def test_ddp_with_gloo_keeps_both_ranks_identical(tmp_path):
    script = tmp_path / "ddp_train.py"
    script.write_text(DDP_SCRIPT.format(repo=str(REPO), out=str(tmp_path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.testing.assert_close(ranks[0]["after"], ranks[1]["after"], rtol=0, atol=1e-6)
    assert not torch.allclose(ranks[0]["before"], ranks[0]["after"])
