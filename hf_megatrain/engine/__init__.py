"""The runtime: conversion of an HF model, the streaming executor, and the engine that runs a training step."""

from .conversion_plan import default_decay_names
from .runtime import MegaTrainEngine, MegaTrainOutput

__all__ = ["MegaTrainEngine", "MegaTrainOutput", "default_decay_names"]
