"""Bring your own optimizer and batch norm: groups, whole-tensor optimizers, unused parameters,
synchronised batch norm; each against an independent plain-PyTorch loop over the same batches,
in float64 (``assert_exact``)."""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import SmallConvNet, TinyGPT, assert_exact, assert_same_parameters, plain_fit, tiny_dataset, \
    token_dataset
from sn_trainer import ConfigError, Trainer
from sn_trainer.checkpoint import CheckpointDir
from sn_trainer import checkpoint
from sn_trainer.optim import ELEMENTWISE

pytestmark = [pytest.mark.timeout(180), pytest.mark.contract]


def decay_matrices_only(model, weight_decay=0.1, lr_no_decay=0.02):
    """A small GPT's groups: decay on 2-d weights (matmuls, embeddings) only; another lr for the rest."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": lr_no_decay}]


def gpt_step(model, batch):
    _, loss = model(*batch)
    return loss


ADAMW = functools.partial(torch.optim.AdamW, lr=0.01)
SGD_PLAIN = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
F64 = torch.float64


def constant(step):
    return 1.0


def halving(step):
    return 0.5 ** step


@pytest.mark.parametrize("workers, batch_size", [(1, 6), (2, 7), (3, 7)])
def test_two_adamw_groups_on_a_gpt_with_tied_weights(workers, batch_size):
    torch.manual_seed(0)
    model = TinyGPT().double()
    reference = plain_fit(copy.deepcopy(model), token_dataset(), batch_size, steps=4, seed=2,
                          optimizer=lambda m: ADAMW(decay_matrices_only(m)), loss=gpt_step)
    schedule = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=[constant, halving])
    reference_scheduled = plain_fit(copy.deepcopy(model), token_dataset(), batch_size, steps=4, seed=2,
                                    optimizer=lambda m: ADAMW(decay_matrices_only(m)), loss=gpt_step,
                                    scheduler=schedule)
    scheduled = copy.deepcopy(model)
    Trainer(workers=workers, batch_size=batch_size, max_steps=4, seed=2).fit(
        model, token_dataset(), optimizer=ADAMW, step_fn=gpt_step, param_groups=decay_matrices_only)
    assert_exact(model, reference)
    # A scheduler with one lambda per group: every worker's optimizer has every group.
    Trainer(workers=workers, batch_size=batch_size, max_steps=4, seed=2).fit(
        scheduled, token_dataset(), optimizer=ADAMW, step_fn=gpt_step, param_groups=decay_matrices_only,
        scheduler=schedule)
    assert_exact(scheduled, reference_scheduled)
    assert not torch.allclose(scheduled.ln_f.bias, model.ln_f.bias)  # the second group's lr did change


class Branches(nn.Module):
    """One branch used every other forward, one never: plain PyTorch leaves their .grad None then."""

    def __init__(self):
        super().__init__()
        self.net = SmallConvNet()
        self.sometimes = nn.Linear(3, 3)
        self.never = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        out = self.net(x)
        return out + self.sometimes(out) if self.calls % 2 == 0 else out


@pytest.mark.parametrize("optimizer", [
    functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=0.01),
    functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.05),
], ids=["sgd", "adamw"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_parameters_without_gradient_are_left_as_plain_pytorch_leaves_them(optimizer, workers):
    torch.manual_seed(0)
    model = Branches().double()
    untouched = model.never.weight.detach().clone()
    reference = plain_fit(copy.deepcopy(model), tiny_dataset(dtype=F64), 7, steps=5, seed=3,
                          optimizer=lambda m: optimizer(m.parameters()),
                          loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    Trainer(workers=workers, batch_size=7, max_steps=5, seed=3).fit(model, tiny_dataset(dtype=F64), optimizer=optimizer)
    assert torch.equal(model.never.weight, untouched)  # no decay, no momentum
    assert_exact(model, reference)  # 'sometimes': the steps it missed left no trace


class BatchNormNet(nn.Module):
    """cifar10_quick's shape with batch norm after each convolution."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 6, 3),
                                      nn.BatchNorm2d(6, momentum=None), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(6 * 4 * 4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))

    def forward(self, x):
        return self.head(self.features(x))


@pytest.mark.parametrize("workers, batch_size", [(1, 12), pytest.param(2, 12, marks=pytest.mark.quick), (3, 11)])
def test_sync_batchnorm_equals_one_process_with_the_global_batch(workers, batch_size):
    torch.manual_seed(0)
    model = BatchNormNet().double()
    sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    reference = plain_fit(copy.deepcopy(model), tiny_dataset(dtype=F64), batch_size, steps=4, seed=3,
                          optimizer=lambda m: sgd(m.parameters()), loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    Trainer(workers=workers, batch_size=batch_size, max_steps=4, seed=3, sync_batchnorm=True).fit(
        model, tiny_dataset(dtype=F64), optimizer=sgd)
    assert_exact(model, reference)  # the running statistics too


def test_without_sync_batchnorm_statistics_are_per_worker_like_ddp():
    torch.manual_seed(0)
    model = BatchNormNet().double()
    sgd = functools.partial(torch.optim.SGD, lr=0.05)
    reference = plain_fit(copy.deepcopy(model), tiny_dataset(dtype=F64), 12, steps=2, seed=3,
                          optimizer=lambda m: sgd(m.parameters()), loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    Trainer(workers=2, batch_size=12, max_steps=2, seed=3).fit(model, tiny_dataset(dtype=F64), optimizer=sgd)
    assert not torch.allclose(model.features[1].running_mean, reference.features[1].running_mean, rtol=1e-4)


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.quick), 3])
def test_adafactor_gets_whole_tensors_and_equals_plain_pytorch(workers):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    adafactor = functools.partial(torch.optim.Adafactor, lr=0.01)
    reference = plain_fit(copy.deepcopy(model), tiny_dataset(dtype=F64), 7, steps=4, seed=3,
                          optimizer=lambda m: adafactor(m.parameters()),
                          loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    sliced = copy.deepcopy(model)
    result = Trainer(workers=workers, batch_size=7, max_steps=4, seed=3).fit(model, tiny_dataset(dtype=F64),
                                                                             optimizer=adafactor)
    assert result.plan["shards"] == "tensors"
    assert_exact(model, reference)
    # Every auto the run decided, with its reason (summary.json's plan holds the same), comm=auto as
    # the workers chose it at start-up.
    decided = result.plan["decisions"]
    assert decided["shards"] == {"value": "tensors", "why": "shards=auto: tensors, the kind tests prove exact for "
                                                             "Adafactor"}
    assert {"threads", "channels_last", "prefetch", "pin", "comm"} <= set(decided)
    assert decided["comm"]["value"] == result.comm and decided["comm"]["why"].startswith("comm=auto: ")
    assert all(f"{name}=auto" in d["why"] for name, d in decided.items())
    # Given 1-d slices (elementwise shards), Adafactor cannot factor a matrix: it trains something else.
    Trainer(workers=workers, batch_size=7, max_steps=4, seed=3, shards="elements").fit(sliced, tiny_dataset(dtype=F64),
                                                                                       optimizer=adafactor)
    assert not torch.allclose(sliced.fc.weight, reference.fc.weight, rtol=1e-5, atol=1e-6)


def test_lbfgs_is_refused_before_any_worker_starts(no_leaks):
    with pytest.raises(ConfigError, match="LBFGS cannot train with sn_trainer: it re-evaluates the loss through a "
                                          "closure"):
        Trainer(workers=2, batch_size=8, max_steps=2).fit(SmallConvNet(), tiny_dataset(),
                                                          optimizer=functools.partial(torch.optim.LBFGS, lr=0.1))


def test_a_resume_with_groups_across_a_change_of_worker_count(tmp_path):
    def run(model, workers, steps, **settings):
        Trainer(workers=workers, batch_size=7, max_steps=steps, seed=2, checkpoint_dir=str(tmp_path / "ckpt"),
                checkpoint_every_steps=2, **settings).fit(model, token_dataset(), optimizer=ADAMW, step_fn=gpt_step,
                                                          param_groups=decay_matrices_only)
        return model

    torch.manual_seed(0)
    start = TinyGPT()
    whole = run(copy.deepcopy(start), 2, 6, checkpoint_keep=10)
    saved = checkpoint.load(CheckpointDir(tmp_path / "ckpt").latest())
    assert [g["weight_decay"] for g in saved["optimizer"]["param_groups"]] == [0.1, 0.0]
    assert saved["optimizer"]["param_groups"][1]["lr"] == 0.02
    for path in sorted((tmp_path / "ckpt").iterdir())[1:]:
        path.unlink()  # keep step 2 only
    resumed = run(copy.deepcopy(start), 3, 6, resume="latest")
    assert_same_parameters(resumed, whole)


@pytest.mark.parametrize("name", [cls.__name__ for cls in ELEMENTWISE])
def test_every_optimizer_sharded_by_elements_is_proven_elementwise(name):
    """sn_trainer gives these any slice of the parameters (shards=elements): each must step a slice
    exactly as it steps the whole. W=3 with batch 7 cuts every tensor of SmallConvNet unevenly."""
    torch.manual_seed(0)
    assert three_workers_against_plain(SmallConvNet().double(),
                                       functools.partial(getattr(torch.optim, name), lr=0.01)) == "elements"


def three_workers_against_plain(model, optimizer) -> str:
    """Train ``model`` with 3 workers and in a plain loop; assert they agree; the shard kind that ran."""
    reference = plain_fit(copy.deepcopy(model), tiny_dataset(dtype=F64), 7, steps=4, seed=3,
                          optimizer=lambda m: optimizer(m.parameters()),
                          loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    result = Trainer(workers=3, batch_size=7, max_steps=4, seed=3).fit(model, tiny_dataset(dtype=F64),
                                                                       optimizer=optimizer)
    assert_exact(model, reference)
    return result.plan["shards"]


class TwoTensors(nn.Module):
    """Fewer tensors than workers: whole-tensor shards leave a worker with nothing to update."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 3)

    def forward(self, x):
        return self.fc(x.flatten(1))


def test_a_worker_with_no_tensor_of_its_own_trains_along():
    torch.manual_seed(0)
    assert three_workers_against_plain(TwoTensors().double(),
                                       functools.partial(torch.optim.Adafactor, lr=0.01)) == "tensors"


def decay_with_the_frozen(model):
    """Groups as a fine-tuning script writes them: over model.parameters(), frozen ones included."""
    return [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]


@pytest.mark.parametrize("workers", [1, 2])
def test_groups_holding_frozen_parameters_train_as_torch_optim_does(workers):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    model.conv.requires_grad_(False)
    frozen = model.conv.weight.detach().clone()
    reference = plain_fit(copy.deepcopy(model), tiny_dataset(dtype=F64), 7, steps=4, seed=3,
                          optimizer=lambda m: ADAMW(decay_with_the_frozen(m)),
                          loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    Trainer(workers=workers, batch_size=7, max_steps=4, seed=3).fit(model, tiny_dataset(dtype=F64), optimizer=ADAMW,
                                                                    param_groups=decay_with_the_frozen)
    assert torch.equal(model.conv.weight, frozen)
    assert_exact(model, reference)


class StatelessBatchNormNet(nn.Module):
    """Batch norm without running statistics: it normalises by the batch's own, in evaluation too."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm = nn.BatchNorm2d(4, track_running_stats=False)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


@pytest.mark.parametrize("comm", ["shm", "gloo"])
def test_sync_batchnorm_without_running_statistics_evaluates_uneven_slices(comm):
    """13 evaluation samples, 2 workers, chunks of 2: worker 0 evaluates 4 chunks, worker 1 three.
    Each chunk is normalised by its own statistics, as a plain evaluation loop does per batch."""
    from helpers import worker_slices

    torch.manual_seed(0)
    model = StatelessBatchNormNet().double()
    evaluation = tiny_dataset(n=13, seed=4, dtype=F64)
    result = Trainer(workers=2, batch_size=8, max_steps=2, seed=3, sync_batchnorm=True, comm=comm,
                     eval_batch_size=2).fit(model, tiny_dataset(dtype=F64), eval_set=evaluation, optimizer=SGD_PLAIN)
    inputs, targets = evaluation.tensors
    model.eval()
    with torch.no_grad():
        total = sum(F.cross_entropy(model(inputs[lo:hi]), targets[lo:hi], reduction="sum").item()
                    for start, stop in worker_slices(13, 2) for lo in range(start, stop, 2)
                    for hi in [min(lo + 2, stop)])
    assert result.eval_loss == pytest.approx(total / 13, rel=1e-12)


class BranchesPerWorker(nn.Module):
    """Batch norm, and a layer only slices of an even size pass through: with batch 7 and two
    workers, worker 0 (4 samples) uses it and worker 1 (3 samples) does not."""

    def __init__(self):
        super().__init__()
        self.net = BatchNormNet()
        self.extra = nn.Linear(3, 3)

    def forward(self, x):
        out = self.net(x)
        return out + self.extra(out) if len(x) % 2 == 0 else out


def test_gloo_buckets_sync_batchnorm_and_a_branch_one_worker_takes_agree_with_shm():
    """The branch depends on the slice, so the run is not one process's (its first step is found
    to differ): with split="like_ddp" it trains on, like DDP, through either reducer alike."""
    results = []
    for comm in ("shm", "gloo"):
        torch.manual_seed(0)
        model = BranchesPerWorker().double()
        result = Trainer(workers=2, batch_size=7, max_steps=3, seed=3, sync_batchnorm=True, comm=comm, bucket_kb=1,
                         split="like_ddp").fit(model, tiny_dataset(dtype=F64), optimizer=SGD_PLAIN)
        assert result.plan["exactness"].startswith("like DDP from step 1: step 1 differs from one process's step "
                                                   "on the same global batch: whether extra.weight gets a gradient")
        results.append(model)
    assert_exact(results[1], results[0])


class SparseBag(nn.Module):
    """Token ids into a sparse-gradient embedding bag, then a linear classifier."""

    def __init__(self, sparse: bool = True):
        super().__init__()
        self.body = nn.Module()
        self.body.bag = nn.EmbeddingBag(7, 4, sparse=sparse)
        self.fc = nn.Linear(4, 3)

    def forward(self, ids):
        return self.fc(self.body.bag(ids))


def token_classes(n: int = 16):
    g = torch.Generator().manual_seed(1)
    ids, classes = torch.randint(0, 7, (n, 3), generator=g), torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.TensorDataset(ids, classes)


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if the Trainer launches its training workers."""
    from sn_trainer.fit import session

    def refuse(*args, **kwargs):
        raise AssertionError("a worker was launched")

    monkeypatch.setattr(session, "run_workers", refuse)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_sparse_gradient_is_refused_in_one_line_naming_the_module(workers, no_launch, monkeypatch, no_leaks):
    from sn_trainer.fit import resolve

    # Refused from the model alone: not even the rehearsal (which runs the model) is reached.
    monkeypatch.setattr(resolve, "run_workers", lambda *a, **k: pytest.fail("the rehearsal was launched"))
    monkeypatch.setattr(resolve.preflight, "rehearse", lambda *a, **k: pytest.fail("the rehearsal ran"))
    with pytest.raises(ConfigError) as raised:
        Trainer(workers=workers, batch_size=8, max_steps=2).fit(
            SparseBag(), token_classes(), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    message = str(raised.value)
    assert "\n" not in message
    assert "'body.bag'" in message and "EmbeddingBag" in message and "sparse=True" in message
    assert "sparse=False" in message and "SparseAdam" in message


@pytest.mark.parametrize("workers", [1, 2])
def test_sparse_adam_is_refused_at_every_worker_count(workers, no_launch, no_leaks):
    with pytest.raises(ConfigError) as raised:
        Trainer(workers=workers, batch_size=8, max_steps=2).fit(
            SparseBag(sparse=False), token_classes(), optimizer=functools.partial(torch.optim.SparseAdam, lr=0.1))
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("SparseAdam cannot train with sn_trainer: it needs sparse gradients")
    assert "Adam" in message and "AdamW" in message and "sparse=False" in message and "closure" not in message
