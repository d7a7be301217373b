"""Batch norm over the global batch: statistics summed across the workers (and nodes) of a run.

Each worker holds a slice of the global batch. In training mode a synchronised batch norm sums
every worker's per-channel sum, sum of squares and count before normalising, and sums the two
per-channel terms of its backward pass, so that activations, gradients and running statistics
equal one process's with the whole batch. In evaluation it synchronises nothing (running
statistics, or each evaluation chunk's own). PyTorch's own SyncBatchNorm runs on GPUs only.
"""
from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import nn

Sum = Callable[[torch.Tensor], torch.Tensor]  # sums a float64 tensor over every worker, in place


def synchronise(model: nn.Module, global_sum: Sum) -> int:
    """Make every batch norm of ``model`` normalise over the global batch; return how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.forward = types.MethodType(_synchronised_forward(global_sum), module)
            count += 1
    return count


def max_channels(model: nn.Module) -> int:
    """The widest batch norm: what one of its all-reduces carries is 2 x channels + 1 values."""
    return max((m.num_features for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)),
               default=0)


def _synchronised_forward(global_sum: Sum):
    def forward(self: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training:
            # Evaluation: by the running statistics, or (without them) by this chunk's own, as a
            # plain evaluation loop normalises each of its batches. Workers evaluate different
            # numbers of chunks, so nothing here may wait for the others.
            return nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                            not self.track_running_stats, 0.0, self.eps)
        factor = 0.0
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
        weight = self.weight if self.weight is not None else torch.ones(x.shape[1], dtype=x.dtype)
        bias = self.bias if self.bias is not None else torch.zeros(x.shape[1], dtype=x.dtype)
        running = (self.running_mean, self.running_var) if self.track_running_stats else None
        return _GlobalBatchNorm.apply(x, weight, bias, self.eps, factor, running, global_sum)

    return forward


class _GlobalBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, factor, running, global_sum):
        dims = [0] + list(range(2, x.dim()))
        channels = x.shape[1]
        shape = [1, channels] + [1] * (x.dim() - 2)
        stats = torch.cat([x.sum(dim=dims, dtype=torch.float64), (x.double() ** 2).sum(dim=dims),
                           torch.tensor([x.numel() / channels], dtype=torch.float64)])
        global_sum(stats)
        n = stats[-1].item()
        if n <= 1:
            raise ValueError(f"batch norm needs more than 1 value per channel over the global batch, got {n:g}")
        mean = stats[:channels] / n
        var = (stats[channels : 2 * channels] / n - mean * mean).clamp_min(0)
        invstd = (var + eps).rsqrt()
        if running is not None:
            running_mean, running_var = running
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_((var * n / (n - 1)).to(running_var.dtype), alpha=factor)
        xhat = (x - mean.to(x.dtype).view(shape)) * invstd.to(x.dtype).view(shape)
        ctx.save_for_backward(xhat, weight, invstd.to(x.dtype))
        ctx.n, ctx.global_sum = n, global_sum
        return xhat * weight.view(shape) + bias.view(shape)

    @staticmethod
    def backward(ctx, grad_out):
        xhat, weight, invstd = ctx.saved_tensors
        dims = [0] + list(range(2, grad_out.dim()))
        channels = grad_out.shape[1]
        shape = [1, channels] + [1] * (grad_out.dim() - 2)
        sum_dy = grad_out.sum(dim=dims, dtype=torch.float64)
        sum_dy_xhat = (grad_out * xhat).sum(dim=dims, dtype=torch.float64)
        grad_weight, grad_bias = sum_dy_xhat.to(weight.dtype), sum_dy.to(weight.dtype)  # this slice's share
        sums = ctx.global_sum(torch.cat([sum_dy, sum_dy_xhat]))
        mean_dy = (sums[:channels] / ctx.n).to(grad_out.dtype).view(shape)
        mean_dy_xhat = (sums[channels:] / ctx.n).to(grad_out.dtype).view(shape)
        scale = (weight * invstd).view(shape)
        grad_x = scale * (grad_out - mean_dy - xhat * mean_dy_xhat)
        return grad_x, grad_weight, grad_bias, None, None, None, None
