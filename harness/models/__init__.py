"""Models: plain `nn.Module`s and nothing distributed. The decoder-only LM and the shared Transformer layers
(`transformer.py`), the protein encoder and its heads (`encoder.py`), the translation encoder-decoder (`seq2seq.py`)
and its decoding (`decoding.py`), the price forecaster (`patch.py`), how a model lists its layers for a pipeline
(`pipeline.py`), what a model does when its sequences are split over ranks (`sequence.py`: hooks, no collectives),
analytic FLOPs (`flops.py`), and Hugging Face models and tokenizers (`hf.py`).

May import: config. Parallelism is applied from outside (`harness.distributed`); a contract in pyproject.toml keeps
DeepSpeed and the harness's distributed code out of here.
"""
