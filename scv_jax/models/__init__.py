"""Models the speculative decoder can drive: a Llama-style Flax NNX transformer, the demo pair and
Hugging Face checkpoints (Llama, Qwen2, Qwen3, Mistral; the mixtures of experts Qwen3-MoE, Mixtral and
gpt-oss) with their tokenizers, and EAGLE-3 draft heads."""

from scv_jax.models.config import Llama3RopeScaling, TransformerConfig, YarnRopeScaling
from scv_jax.models.eagle3 import Eagle3Head, Eagle3Output, load_eagle3, save_eagle3
from scv_jax.models.hf import load_hf
from scv_jax.models.hub import checkpoint_dir
from scv_jax.models.protocol import PackedTokens, PagedForwardOutput, PagedModel, StagedKV
from scv_jax.models.tokenizer import Tokenizer, load_tokenizer
from scv_jax.models.transformer import Transformer
from scv_jax.models.weights import load_demo, load_demo_head, load_model, save_model

__all__ = ["TransformerConfig", "Llama3RopeScaling", "YarnRopeScaling", "Transformer", "PagedModel", "PagedForwardOutput",
           "PackedTokens", "StagedKV", "load_demo", "load_model", "save_model", "load_hf", "load_tokenizer",
           "Tokenizer", "load_eagle3", "save_eagle3", "load_demo_head", "Eagle3Head", "Eagle3Output",
           "checkpoint_dir"]
