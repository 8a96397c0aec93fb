"""Training draft heads for a target: ``verispec train-draft`` (``train_draft``)."""

from verispec.train.train_draft import TrainDraftConfig, train_draft

__all__ = ["TrainDraftConfig", "train_draft"]
