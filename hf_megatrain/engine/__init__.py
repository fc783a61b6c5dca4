"""The runtime: conversion of an HF model, the streaming executor, and the engine that runs a training step."""

from .runtime import MegaTrainEngine, MegaTrainOutput, default_decay_names

__all__ = ["MegaTrainEngine", "MegaTrainOutput", "default_decay_names"]
