"""MLM models. They know nothing about optimizers, checkpoints or meshes beyond logical axis names."""

from flatlm.models.bert import TABLE3, Bert, BertConfig
from flatlm.models.lstm import BiLSTM, LSTMConfig

__all__ = ["TABLE3", "Bert", "BertConfig", "BiLSTM", "LSTMConfig"]
