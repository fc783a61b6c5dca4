"""Exports of a trained model: the standard HF checkpoint streamed from the FP32 masters (``weights``) and PEFT
adapter / merged folders (``peft_support``). Below the engine: both see it only through the attributes they read
(engine/model_view.py and the Trainer call them), never import it.
"""
