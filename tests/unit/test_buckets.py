"""A bucket's life in one iteration, without a process group: slots, readiness, write-back."""

from __future__ import annotations

import torch

from phalanx.ddp.buckets import Bucket, assign_buckets


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]


def test_slots_alias_one_flat_buffer_and_flags_follow() -> None:
    params = _params()
    bucket = Bucket(0, [0, 1], params, is_last=True, flag_slots=2, grads_in_views=False)
    assert bucket.buffer.numel() == 6 + 4 + 2 and bucket.flags.numel() == 2
    assert bucket.views[0].shape == (3, 2) and bucket.views[1].shape == (4,)
    bucket.views[1].fill_(7.0)
    assert bucket.grads[6:].tolist() == [7.0] * 4


def test_mark_ready_scales_while_copying_and_reports_full() -> None:
    # Parameters of 20 and 32 KiB: above SMALL_PARAM_BYTES, each is copied in its hook.
    params = [torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(8192))]
    bucket = Bucket(0, [0, 1], params, is_last=False, flag_slots=0, grads_in_views=False)
    assert bucket.copy_on_ready and not bucket.fill_at_launch
    bucket.scale = torch.tensor(0.5)
    params[0].grad = torch.ones(64, 80)
    params[1].grad = None  # no gradient: the slot is sent as zeros
    bucket.views[1].fill_(9.0)
    assert bucket.mark_ready(0, params[0]) is False
    assert bucket.views[0].eq(0.5).all()  # copied, and averaged, in the hook itself
    assert bucket.mark_ready(1, params[1]) is True
    assert bucket.views[1].eq(0.0).all()
    assert bucket.scaled


class _Sent:
    """A reduction that only records what the bucket held when it launched."""

    keeps_gradients = True

    def start(self, bucket: Bucket) -> None:
        """BucketReduction.start: what Bucket.launch calls."""
        self.sent = bucket.grads.clone()


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def test_small_parameters_fill_at_launch_bit_for_bit_as_the_hooks_would() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 16)) for _ in range(4)]  # 512 B each
    bucket = Bucket(0, [0, 1, 2, 3], params, is_last=False, flag_slots=0, grads_in_views=False)
    assert bucket.fill_at_launch and not bucket.copy_on_ready
    scale = bucket.scale = torch.tensor(1.0 / 3.0)  # not a power of two: rounding shows
    for p in params:
        p.grad = torch.randn(8, 16)
    stale = params[3].grad
    for slot in range(3):
        assert bucket.mark_ready(slot, params[slot]) is False
    assert bucket.grads.eq(0).all(), "nothing copied in the hooks"
    bucket.mark_missing(3)  # never came this iteration: zeros, whatever .grad still holds
    reduction = _Sent()
    bucket.launch(reduction)  # type: ignore[arg-type]
    expected = torch.cat([torch.mul(_grad(p), scale).reshape(-1) for p in params[:3]])
    assert torch.equal(reduction.sent[: expected.numel()], expected)  # the hooks' multiply
    assert reduction.sent[expected.numel() :].eq(0).all() and stale is params[3].grad
    bucket.reset()
    assert not bucket.missing  # the next iteration copies every slot again


def test_write_back_fills_grads_and_skips_unused() -> None:
    params = _params()
    bucket = Bucket(0, [0, 1], params, is_last=False, flag_slots=0, grads_in_views=False)
    params[0].grad = torch.zeros(3, 2)
    bucket.grads.fill_(3.0)
    bucket.write_back(skip={1})
    assert params[0].grad.tolist() == [[3.0, 3.0]] * 3
    assert params[1].grad is None


def test_gradient_as_bucket_view_binds_grad_to_its_slot() -> None:
    params = _params()
    params[0].grad = torch.full((3, 2), 2.0)
    bucket = Bucket(0, [0, 1], params, is_last=False, flag_slots=0, grads_in_views=True)
    bucket.scale = torch.tensor(0.5)
    bucket.bind_grads_to_views()
    assert params[0].grad is bucket.views[0] and bucket.views[0].sum() == 12.0
    assert not bucket.scaled  # raw sums: the reduction must average before sending


def test_assignment_first_bucket_small_and_split_by_dtype() -> None:
    params = [torch.zeros(100), torch.zeros(100, dtype=torch.float64), torch.zeros(100)]
    order = [2, 1, 0]
    buckets = assign_buckets(params, order, caps=[400, 10_000])
    assert buckets == [[2], [1], [0]]  # the float32 stream closes its 400-byte first bucket
