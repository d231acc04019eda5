"""config.json contents of published EAGLE-3 heads and head-training configs, verbatim, for
tests/models/test_eagle3.py's published-config tests (which shrink their sizes and write random
weights of the matching layout). Sources (no network here: read from the repositories' files):

- ``SPECFORGE``: sgl-project/SpecForge, configs/*.json at commit a6b6b02 (2026-08-08): the draft configs
  SpecForge trains and publishes heads with (its llama3-8B one has ``max_position_embeddings`` 2048 and
  no ``rope_theta``; yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's config sets 2048 too, per vLLM issue #48894,
  whose rest was not seen).
- ``SAFEAILAB_TRAINER``: SafeAILab/EAGLE, eagle/traineagle3/config.json at commit cb7e084: the config
  SafeAILab's EAGLE-3 trainer builds heads from (architectures ``LlamaForCausalLM``).
- ``SPECULATORS_ISSUE_1065``: the config of a head trained with speculators 0.8.0.dev0, quoted in
  vllm-project/speculators issue #1065 (four aux ids, a sliding-window layer).
"""

SPECFORGE = {
    "llama3-8B-eagle3.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 128000, "eos_token_id": 128001,
         "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
         "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32,
         "num_key_value_heads": 8, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
         "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache":
         True, "vocab_size": 128256, "draft_vocab_size": 32000},
    "qwen3-8b-eagle3.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
         "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size":
         4096, "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
         "max_window_layers": 36, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 1,
         "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
         "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
         "draft_vocab_size": 32000},
    "qwen3-30B-A3B-eagle3.1.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
         "bos_token_id": 151643, "eos_token_id": 151645, "fc_norm": True, "head_dim": 128, "hidden_act": "silu",
         "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings":
         2048, "max_window_layers": 48, "model_type": "llama", "norm_output": True, "num_attention_heads": 32,
         "num_hidden_layers": 1, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None,
         "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype":
         "bfloat16", "transformers_version": "4.53.2", "use_cache": True, "use_sliding_window": False,
         "vocab_size": 151936, "draft_vocab_size": 32000},
    "gpt-oss-20B-eagle3.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1,
         11, 21]}, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initializer_range": 0.02,
         "intermediate_size": 17280, "max_position_embeddings": 4096, "model_type": "llama",
         "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 1, "pad_token_id": 0,
         "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version":
         "4.52.3", "use_cache": True, "vocab_size": 201088, "draft_vocab_size": 32000},
    "deepseek-v3-671b-eagle3.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1,
         29, 57], "use_aux_hidden_state": True}, "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act":
         "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 40960,
         "max_position_embeddings": 163840, "model_type": "llama", "num_attention_heads": 56,
         "num_key_value_heads": 8, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
         "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.51.0", "use_cache":
         True, "vocab_size": 129280, "draft_vocab_size": 32000},
    "qwen3-235B-A22B-eagle3.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1,
         46, 90], "use_aux_hidden_state": True}, "attention_bias": False, "attention_dropout": 0.0,
         "bos_token_id": 151643, "draft_vocab_size": 32000, "eos_token_id": 151645, "head_dim": 128,
         "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 24576,
         "max_position_embeddings": 40960, "model_type": "llama", "num_attention_heads": 64,
         "num_hidden_layers": 1, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
         "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version":
         "4.51.0", "use_cache": True, "vocab_size": 151936},
    "gemma3-1b-eagle3.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
         "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "head_dim": 256, "hidden_act": "silu",
         "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings":
         32768, "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 1, "num_key_value_heads":
         1, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.50.0", "use_cache":
         True, "use_sliding_window": False, "vocab_size": 262144, "draft_vocab_size": 32000,
         "target_model_type": "gemma3_text"},
    "phi4-eagle3.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
         "bos_token_id": 100257, "eos_token_id": 100257, "pad_token_id": 100257, "hidden_act": "silu",
         "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17920, "max_position_embeddings":
         16384, "model_type": "phi3", "num_attention_heads": 40, "num_hidden_layers": 1, "num_key_value_heads":
         10, "rms_norm_eps": 1e-05, "rope_theta": 250000.0, "tie_word_embeddings": False, "torch_dtype":
         "bfloat16", "transformers_version": "4.47.0", "use_cache": True, "vocab_size": 100352,
         "draft_vocab_size": 32000},
    "qwq-32B-eagle3.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "attention_dropout": 0.0, "bos_token_id": 151643,
         "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
         "intermediate_size": 27648, "max_position_embeddings": 40960, "max_window_layers": 64, "model_type":
         "qwen2", "num_attention_heads": 40, "num_hidden_layers": 1, "num_key_value_heads": 8, "rms_norm_eps":
         1e-05, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype":
         "bfloat16", "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False,
         "vocab_size": 152064, "draft_vocab_size": 32000},
    "longcat-flash-eagle3.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
         "bos_token_id": 1, "eos_token_id": 2, "head_dim": 128, "hidden_act": "silu", "hidden_size": 6144,
         "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 131072,
         "max_window_layers": 48, "model_type": "llama", "num_attention_heads": 64, "num_hidden_layers": 1,
         "num_key_value_heads": 16, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000000.0,
         "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "transformers_version": "4.53.2", "use_cache": True, "use_sliding_window": False, "vocab_size": 131072,
         "draft_vocab_size": 131072},
    "qwen3-next-80b-a3b-eagle3.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "attention_dropout": 0.0, "bos_token_id": 151643,
         "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 256, "hidden_act": "silu", "hidden_size":
         2048, "initializer_range": 0.02, "intermediate_size": 16384, "max_position_embeddings": 262144,
         "model_type": "llama", "num_attention_heads": 16, "num_hidden_layers": 1, "num_key_value_heads": 2,
         "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16", "transformers_version": "4.57.0.dev0", "use_cache": True,
         "use_sliding_window": False, "vocab_size": 151936, "draft_vocab_size": 32000},
    "deepseek-v2-lite-eagle3.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
         "bos_token_id": 100000, "eos_token_id": 100001, "head_dim": 128, "hidden_act": "silu", "hidden_size":
         2048, "initializer_range": 0.02, "intermediate_size": 10944, "max_position_embeddings": 163840,
         "max_window_layers": 64, "model_type": "llama", "num_attention_heads": 16, "num_hidden_layers": 1,
         "num_key_value_heads": 16, "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0,
         "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
         "rope_type": "yarn"}, "rope_theta": 10000, "sliding_window": None, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True, "use_sliding_window":
         False, "vocab_size": 102400, "draft_vocab_size": 32000},
    "qwen2-5-vl-7b-eagle3.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
         "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size":
         3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 8192,
         "max_window_layers": 28, "model_type": "llama", "target_model_type": "qwen2_5_vl",
         "num_attention_heads": 28, "num_hidden_layers": 1, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
         "pretraining_tp": 1, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "rope_theta":
         1000000, "sliding_window": 32768, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
         "draft_vocab_size": 32000},
    "llama4-scout-17B-16E-eagle3.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "hidden_act": "silu", "hidden_size": 5120,
         "initializer_range": 0.02, "intermediate_size": 32768, "max_position_embeddings": 2048, "model_type":
         "llama", "num_attention_heads": 40, "num_key_value_heads": 8, "num_hidden_layers": 1, "pad_token_id":
         0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "transformers_version": "4.52.3", "use_cache": True, "vocab_size": 202048, "draft_vocab_size": 32000},
    "qwen2.5-7b-eagle3.json":
        {"architectures": ["LlamaForCausalLMEagle3"], "attention_bias": False, "attention_dropout": 0.0,
         "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584,
         "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
         "max_window_layers": 28, "model_type": "llama", "num_attention_heads": 28, "num_hidden_layers": 1,
         "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
         "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
         "draft_vocab_size": 16000},
}

SAFEAILAB_TRAINER = (
    {"architectures": ["LlamaForCausalLM"], "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act":
     "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
     "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32, "num_key_value_heads":
     8, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
     "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True, "vocab_size": 128256,
     "draft_vocab_size": 32000}
)

SPECULATORS_ISSUE_1065 = (
    {"architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
     "draft_vocab_size": 32000, "dtype": "bfloat16", "eagle_aux_hidden_state_layer_ids": [2, 46, 91, 93],
     "embed_requires_grad": False, "fc_norm": False, "norm_before_fc": True, "norm_before_residual": True,
     "norm_output": True, "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
     "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3,
     "verifier_accept_k": 1}], "verifier": {"architectures": ["Qwen3MoeForCausalLM"], "name_or_path":
     "/model/from_s3"}}, "speculators_model_type": "eagle3", "speculators_version": "0.8.0.dev0",
     "target_hidden_size": None, "tie_word_embeddings": False, "transformer_layer_config": {"attention_bias":
     False, "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
     "initializer_range": 0.02, "intermediate_size": 12288, "layer_types": ["sliding_attention"],
     "max_position_embeddings": 262144, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 64,
     "num_hidden_layers": 1, "num_key_value_heads": 4, "pretraining_tp": 1, "rms_norm_eps": 1e-06,
     "rope_scaling": None, "rope_theta": 5000000, "sliding_window": 2048, "use_cache": True,
     "use_sliding_window": True, "vocab_size": 151936}, "transformers_version": "4.57.6"}
)
