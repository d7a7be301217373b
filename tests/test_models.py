"""Every model's forward shape, and the Caffe nets' sizes."""
import pytest
import torch

from sn_trainer.errors import ConfigError
from sn_trainer.models import build_model

pytestmark = pytest.mark.unit  # the unit tier: starts no process


@pytest.mark.parametrize("name, shape, classes, params", [
    ("lenet", (1, 28, 28), 10, 431_080),        # Caffe's lenet_train_test.prototxt
    pytest.param("cifar10_quick", (3, 32, 32), 10, 145_578, marks=pytest.mark.quick),  # Caffe's cifar10_quick_train_test.prototxt
    ("mlp", (1, 28, 28), 10, None),
    ("lenet", (3, 32, 32), 7, None),
    ("resnet18", (1, 28, 28), 10, None),         # torchvision, first conv adapted to 1 channel
])
def test_forward_shape(name, shape, classes, params):
    model = build_model(name, shape, classes)
    assert model(torch.zeros(2, *shape)).shape == (2, classes)
    if params is not None:
        assert sum(p.numel() for p in model.parameters()) == params


def test_unknown_model_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown model 'lenet5'; choose one of lenet, cifar10_quick, "
                                          r"cifar10_quick_bn, mlp or a torchvision classification model \(alexnet"):
        build_model("lenet5", (1, 28, 28), 10)
