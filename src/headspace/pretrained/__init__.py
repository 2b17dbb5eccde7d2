"""Pretrained weights on headspace's own code: ``load(name | folder)``, ``load_bert/gpt2/llama/gguf``.

* :mod:`.hf`: reading and checking a Hugging Face folder (shared by every converter), with
  :mod:`.safetensors_file` (a safetensors header, re-exported by :mod:`.hf`), :mod:`.shards` (a sharded
  folder's files) and :mod:`.empty_weights` (parameters built without values, then written in place);
* :mod:`.bert`, :mod:`.gpt2`, :mod:`.llama`: one converter per architecture (config, tensors, state dict);
* :mod:`.gguf_format` reads GGUF files (its parts: :mod:`.gguf_container`, :mod:`.gguf_config`,
  :mod:`.gguf_tensors`, :mod:`.gguf_tokenizer`; :mod:`.gguf_gemma`: what Gemma 3 files add; :mod:`.gguf_meta`:
  the error and checked metadata reads they share), :mod:`.gguf` puts them on a Decoder (``load_gguf``,
  smollm2, gemma3 from its four chunk packages);
* :mod:`.wrappers`: :class:`LoadedModel` (what a loaded model offers), :class:`PretrainedEncoder`,
  :class:`PretrainedDecoder`;
* :mod:`.registry`: :func:`load` by name or folder, and where the bundled model lives.

Weight layouts: the attention layers are converted by :mod:`headspace.layouts` (``load_hf_bert``:
``query``/``key``/``value``/``output.dense``; ``load_gpt2``: ``c_attn``/``c_proj``, GPT-2's ``Conv1D``
weights stored [in, out]); the rest in each converter.
"""

from .bert import bert_config, bert_state_dict, load_bert
from .gguf import assemble_gemma3_gguf, gemma3_gguf_parts, load_gemma3, load_gguf, load_smollm2
from .gguf_format import GGUFError, read_gguf, smollm2_gguf_path
from .gpt2 import gpt2_config, gpt2_state_dict, load_gpt2
from .llama import LLAMA_MODEL_TYPES, llama_config, llama_from_tensors, llama_state_dict, load_llama
from .registry import MINILM_INSTALL, MINILM_PACKAGE, MODELS, load, minilm_path
from .wrappers import LoadedModel, PretrainedDecoder, PretrainedEncoder, cosine

__all__ = [
    "LLAMA_MODEL_TYPES",
    "MINILM_INSTALL",
    "MINILM_PACKAGE",
    "MODELS",
    "GGUFError",
    "LoadedModel",
    "PretrainedDecoder",
    "PretrainedEncoder",
    "assemble_gemma3_gguf",
    "bert_config",
    "bert_state_dict",
    "cosine",
    "gemma3_gguf_parts",
    "gpt2_config",
    "gpt2_state_dict",
    "llama_config",
    "llama_from_tensors",
    "llama_state_dict",
    "load",
    "load_bert",
    "load_gemma3",
    "load_gguf",
    "load_gpt2",
    "load_llama",
    "load_smollm2",
    "minilm_path",
    "read_gguf",
    "smollm2_gguf_path",
]
