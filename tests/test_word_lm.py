"""examples/word_lm.py carries its LSTM's hidden state across batches as pytorch/examples'
word_language_model does, exactly at W=1 and 2 against that loop in float64, and a resume from a
checkpoint mid-epoch goes on from the carried state."""
import copy
import functools
import importlib.util
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

from helpers import assert_exact
from sn_trainer import Trainer

pytestmark = pytest.mark.timeout(150)

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "word_lm.py"
TEXT = Path("/usr/share/common-licenses/GPL-3")  # on every Debian machine
COLUMNS, BPTT, STEPS = 3, 10, 7  # 150 tokens: 50 rows, 5 chunks an epoch (the last of 9): 7 steps cross an epoch
ADAM = functools.partial(torch.optim.Adam, lr=0.01)


def example():
    if "word_lm_example" in sys.modules:
        return sys.modules["word_lm_example"]
    spec = importlib.util.spec_from_file_location("word_lm_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)  # the workers cannot import it by name
    return module


def tokens(lm) -> tuple[torch.Tensor, int]:
    words = lm.read_words([TEXT])[:150]
    vocab = {w: i for i, w in enumerate(sorted(set(words)))}
    return torch.tensor([vocab[w] for w in words]), len(vocab)


def plain_word_language_model(model, ids, steps):
    """pytorch/examples' training loop, written again: batchify into columns, bptt chunks in
    order (the last one shorter), the hidden state detached between them and zeroed each epoch."""
    rows = len(ids) // COLUMNS
    data = ids[: rows * COLUMNS].view(COLUMNS, -1).t().contiguous()  # batchify: [row, column]
    opt = ADAM(model.parameters())
    done = 0
    while done < steps:
        hidden = (torch.zeros(2, COLUMNS, 8, dtype=torch.float64), torch.zeros(2, COLUMNS, 8, dtype=torch.float64))
        for i in range(0, rows - 1, BPTT):
            if done == steps:
                break
            seq_len = min(BPTT, rows - 1 - i)
            inputs, targets = data[i : i + seq_len], data[i + 1 : i + 1 + seq_len]
            hidden = tuple(h.detach() for h in hidden)  # repackage_hidden
            opt.zero_grad()
            output, hidden = model(inputs.t(), hidden)  # the model reads batch-first
            loss = torch.nn.functional.cross_entropy(output.flatten(0, 1), targets.t().flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            opt.step()
            done += 1
    model.carried_by_loop = hidden
    return model


def fit(lm, model, ids, workers, steps=STEPS, **settings):
    return Trainer(workers=workers, batch_size=COLUMNS, shuffle=False, max_steps=steps, clip_grad_norm=0.25,
                   log_every=1, **settings).fit(model, lm.Chunks(ids, COLUMNS, BPTT), step_fn=lm.step, optimizer=ADAM)


def start_model(lm, vocab):
    torch.manual_seed(0)
    return lm.RNNModel(vocab, 8, dropout=0.0, columns=COLUMNS).double()


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.quick), 3])
def test_the_hidden_state_is_carried_as_pytorch_examples_carries_it(workers):
    lm = example()
    ids, vocab = tokens(lm)
    start = start_model(lm, vocab)
    model = copy.deepcopy(start)
    fit(lm, model, ids, workers)
    reference = plain_word_language_model(copy.deepcopy(start), ids, STEPS)
    carried = model.carried.detach().clone()
    with torch.no_grad():
        model.carried.zero_()  # the loop keeps its state in a variable, not in the model
    assert_exact(model, reference)
    # after 7 steps (chunk 1 of the second epoch) chunk 2 starts from slot 0: the loop's last state
    for which in range(2):
        torch.testing.assert_close(carried[0, which].transpose(0, 1), reference.carried_by_loop[which],
                                   rtol=1e-10, atol=1e-12)


def test_a_resume_mid_epoch_goes_on_from_the_carried_state(tmp_path):
    """Checkpoints every 3 steps; the run resumed from step 3's (chunk 3 next, from chunk 2's state)
    ends with the uninterrupted run's weights."""
    lm = example()
    ids, vocab = tokens(lm)
    start = start_model(lm, vocab)
    whole = copy.deepcopy(start)
    fit(lm, whole, ids, 2, checkpoint_dir=str(tmp_path), checkpoint_every_steps=3, checkpoint_keep=5)
    for path in sorted(tmp_path.glob("step-*.pt"))[1:]:
        path.unlink()  # keep step 3's checkpoint only
    resumed = copy.deepcopy(start)
    result = fit(lm, resumed, ids, 2, checkpoint_dir=str(tmp_path), resume="latest")
    assert [r["step"] for r in result.history if "loss" in r][0] == 4
    assert_exact(resumed, whole)
