"""What real projects bring, exact or refused: each against an independent plain-PyTorch loop in float64.

Hugging Face language models, loss subclasses and functional sums, frozen backbones in eval mode,
optimizers that look across tensors, buffers written in forward, numpy and ``random`` inside the
step. Each either trains as one process would on the same global batches (W = 1, 2, 3), or is
refused before any worker starts with one line that says what to do.
"""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from helpers import SmallConvNet, assert_exact, plain_fit, tiny_dataset
from sn_trainer import ConfigError, Trainer

pytestmark = pytest.mark.timeout(240)
F64 = torch.float64
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3)


def sgd_of(model):
    return SGD(model.parameters())


# --- 1. Hugging Face models: model(**batch).loss is a mean over kept tokens ----------------------

class PaddedTokens(Dataset):
    """Token rows padded to 12, of 3 to 12 real tokens: labels -100 on padding, as HF's collators do."""

    def __init__(self, n: int = 40, length: int = 12, vocab: int = 20, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)
        real = torch.randint(3, length + 1, (n,), generator=g)
        self.mask = (torch.arange(length)[None, :] < real[:, None]).long()
        self.labels = self.ids.masked_fill(self.mask == 0, -100)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def causal_lm():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=20, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).double()


def masked_lm():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(config).double()


def model_loss(model, batch):
    return model(**batch).loss


def assert_close_to_fp32(model, reference):
    """Hugging Face computes its loss in float32 whatever the model's dtype (``logits.float()``),
    so the float64 comparison holds to float32's rounding of that last step, not to 1e-10."""
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind, form", [("causal", "shifted_tokens"), ("masked", "tokens_from_logits")])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_hugging_face_language_model_trains_on_the_global_token_mean(kind, form, workers):
    torch.manual_seed(0)
    model = causal_lm() if kind == "causal" else masked_lm()
    data = PaddedTokens()
    reference = plain_fit(copy.deepcopy(model), data, 8, steps=4, seed=3, optimizer=sgd_of, loss=model_loss)
    result = Trainer(workers=workers, batch_size=8, max_steps=4, seed=3).fit(model, data, optimizer=SGD)
    # measured: GPT-2 sums kept tokens when told num_items_in_batch; BERT ignores it, and its loss is its
    # logits' cross-entropy over kept labels, which the workers sum
    assert result.plan["loss_form"] == form
    assert_close_to_fp32(model, reference)


def test_a_scalar_token_mean_is_refused_where_it_splits_and_trains_where_it_does_not(no_leaks):
    torch.manual_seed(0)
    model = causal_lm()
    data = PaddedTokens()
    with pytest.raises(ConfigError, match=r"^step_fn gives a scalar loss that cannot be split over workers exactly: "
                                          r"on 8 samples, .*Return \(loss_sum, count\) from a step_fn instead"):
        Trainer(workers=2, batch_size=8, max_steps=2).fit(model, data, optimizer=SGD, step_fn=model_loss)
    reference = plain_fit(copy.deepcopy(model), data, 8, steps=2, seed=3, optimizer=sgd_of, loss=model_loss)
    Trainer(workers=1, batch_size=8, max_steps=2, seed=3).fit(model, data, optimizer=SGD, step_fn=model_loss)
    assert_close_to_fp32(model, reference)  # one slice a step: its mean is the batch's


# --- 2. a loss subclass runs its own forward; a functional sum is a sum --------------------------

class SmoothedCrossEntropy(nn.CrossEntropyLoss):
    """A subclass with its own forward: cross-entropy plus a penalty on the logits' size."""

    def forward(self, logits, targets):
        return super().forward(logits, targets) + 0.1 * logits.pow(2).mean()


class IgnoringCrossEntropy(nn.CrossEntropyLoss):
    """A subclass whose mean divides by the targets it keeps: the count depends on the data."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits, targets, ignore_index=0)


@pytest.mark.parametrize("loss_fn, form", [
    (SmoothedCrossEntropy(), "mean"),
    (functools.partial(F.cross_entropy, reduction="sum"), "sum"),
], ids=["subclass", "functional-sum"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_loss_subclass_and_a_functional_sum_train_as_written(loss_fn, form, workers):
    torch.manual_seed(0)
    model = SmallConvNet().double()
    lr = 0.05 if form == "mean" else 0.005
    sgd = functools.partial(torch.optim.SGD, lr=lr, momentum=0.9)
    reference = plain_fit(copy.deepcopy(model), tiny_dataset(dtype=F64), 7, steps=4, seed=3,
                          optimizer=lambda m: sgd(m.parameters()), loss=lambda m, b: loss_fn(m(b[0]), b[1]))
    result = Trainer(workers=workers, batch_size=7, max_steps=4, seed=3, log_every=1).fit(
        model, tiny_dataset(dtype=F64), optimizer=sgd, loss_fn=loss_fn)
    assert result.plan["loss_form"] == form
    assert_exact(model, reference)
    if form == "sum":  # reported as plain PyTorch reports it: the global batch's sum
        assert result.history[0]["loss"] > 3


def test_a_loss_whose_denominator_depends_on_the_data_is_refused():
    with pytest.raises(ConfigError, match=r"^loss_fn gives a scalar loss that cannot be split over workers exactly"):
        Trainer(workers=2, batch_size=8, max_steps=2).fit(SmallConvNet(), tiny_dataset(), optimizer=SGD,
                                                          loss_fn=IgnoringCrossEntropy())
