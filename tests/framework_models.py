"""A Hugging Face model small enough for a two-process test: written here, nothing downloaded."""
import torch
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig, PreTrainedModel


class TinyRegressorConfig(PretrainedConfig):
    model_type = "sn-tiny-regressor"

    def __init__(self, features: int = 4, width: int = 8, **kwargs):
        super().__init__(**kwargs)
        self.features, self.width = features, width


class TinyRegressor(PreTrainedModel):
    """Two layers returning ``loss`` the way a transformers model does, in float64."""

    config_class = TinyRegressorConfig

    def __init__(self, config: TinyRegressorConfig):
        super().__init__(config)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(config.features, config.width), nn.Tanh(), nn.Linear(config.width, 1))
        self.net.double()

    def _init_weights(self, module):
        pass  # keep torch's own initialisation, seeded above

    def forward(self, features, labels=None):
        prediction = self.net(features)
        return {"loss": F.mse_loss(prediction, labels), "logits": prediction}
