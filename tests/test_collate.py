"""Samples of any structure, batched by the user's collate function, as a DataLoader with it batches them."""
import copy
import functools

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from sn_trainer import Trainer, UserCodeError

pytestmark = pytest.mark.timeout(240)


class Sentences(Dataset):
    """Token sequences of 3 to 12 tokens: dicts of tensors of different lengths, as a tokenizer gives."""

    def __init__(self, n: int = 40, vocab: int = 20, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, 13, (n,), generator=g)
        self.items = [torch.randint(1, vocab, (int(k),), generator=g) for k in lengths]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i]}


def pad_for_causal_lm(items):
    """What DataCollatorForLanguageModeling(mlm=False) does: pad to the longest, labels -100 on padding."""
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, : len(item["input_ids"])] = item["input_ids"]
        mask[row, : len(item["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def causal_lm():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=20, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).double()


SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_variable_length_samples_padded_by_a_collate_train_exactly(workers):
    """Each worker pads its own slice; with labels -100 on padding the global token mean is the
    plain loop's, whose DataLoader pads each whole batch to its longest."""
    torch.manual_seed(0)
    model = causal_lm()
    data = Sentences()
    reference = copy.deepcopy(model)
    optimizer = SGD(reference.parameters())
    sampler = RandomSampler(data, generator=torch.Generator().manual_seed(3 * 1_000_003))
    for _, batch in zip(range(4), DataLoader(data, batch_size=8, sampler=sampler, drop_last=True,
                                             collate_fn=pad_for_causal_lm)):
        optimizer.zero_grad()
        reference(**batch).loss.backward()
        optimizer.step()
    result = Trainer(workers=workers, batch_size=8, max_steps=4, seed=3).fit(
        model, data, optimizer=SGD, collate_fn=pad_for_causal_lm, eval_set=Sentences(n=13, seed=2))
    assert result.plan["loss_form"] == "shifted_tokens"
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        # Hugging Face computes the loss in float32 whatever the model's dtype: float32's rounding
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-9, msg=lambda m: f"{name}: {m}")
    evaluation = pad_for_causal_lm([Sentences(n=13, seed=2)[i] for i in range(13)])
    with torch.no_grad():
        expected = reference.eval()(**evaluation).loss.item()
    assert result.eval_loss == pytest.approx(expected, rel=1e-6)  # the global token mean, across chunks


class Pairs(Dataset):
    """Float64 features and a class: a tiny classification set."""

    def __init__(self, n: int = 24):
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def even_batches_only(items):
    """A collate that, like timm's Mixup collate, takes only even batches."""
    assert len(items) % 2 == 0, f"batch size should be even, got {len(items)}"
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def mean_step(model, batch):
    """A scalar per-sample mean: the probe measures it (part against part), then looks for ignored labels."""
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.quick)])
def test_a_collate_fn_is_called_with_what_a_worker_gets(workers):
    """Never with one sample (which training never does): the rehearsal collates worker micro-batches
    of 8 // workers (27 samples: never a short rest, when it looks for ignored labels either), and
    training is the plain loop's."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    data = Pairs(27)
    reference = copy.deepcopy(model)
    optimizer = SGD(reference.parameters())
    sampler = RandomSampler(data, generator=torch.Generator().manual_seed(3 * 1_000_003))
    for _, (x, y) in zip(range(3), DataLoader(data, batch_size=8, sampler=sampler, drop_last=True,
                                              collate_fn=even_batches_only)):
        optimizer.zero_grad()
        mean_step(reference, (x, y)).backward()
        optimizer.step()
    result = Trainer(workers=workers, batch_size=8, max_steps=3, seed=3).fit(
        model, data, optimizer=SGD, step_fn=mean_step, collate_fn=even_batches_only)
    assert result.plan["loss_form"] == "mean"
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


def never_collates(items):
    raise ValueError("cannot batch these")


def test_a_collate_fn_that_raises_is_named_with_its_sample_count():
    with pytest.raises(UserCodeError) as raised:
        Trainer(workers=2, batch_size=8, max_steps=2).fit(torch.nn.Linear(4, 3).double(), Pairs(), optimizer=SGD,
                                                          collate_fn=never_collates)
    headline = str(raised.value).splitlines()[0]
    assert "collate_fn raised, called with 4 samples" in headline and "cannot batch these" in headline
