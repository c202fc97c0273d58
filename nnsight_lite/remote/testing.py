"""Small models to serve in tests and benchmarks (importable by Ray's workers).

    mlp()          NNsight of a 3-layer MLP (seeded: every process builds the same weights)
    save_tiny_gpt2(dir)   a 2-layer GPT-2 from a config + a character tokenizer, saved to dir
    save_tiny(m, tok, dir)  a tiny model's matrices spread wider, saved with its tokenizer
    save_tiny_llava(dir)  a 2-layer LLaVA (CLIP vision tower, Llama text model) + its processor
    save_tiny_diffusion(dir)  a tiny Stable Diffusion pipeline (UNet, VAE, CLIP text encoder)
"""

from __future__ import annotations

import torch


def mlp(seed: int = 0, device=None):
    """``NNsight(Sequential(Linear(8, 16), ReLU(), Linear(16, 16), ReLU(), Linear(16, 4)))``."""
    from ..model import NNsight

    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                  torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if device is not None:
        net = net.to(device)
    return NNsight(net)


def save_tiny_gpt2(directory, seed: int = 0) -> str:
    """Save a 2-layer GPT-2 (n_embd 32, random seeded weights) and a character-level tokenizer
    to ``directory``; serve it and open it with ``LanguageModel(directory)``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = char_tokenizer()
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=len(tok), n_positions=64,
                        bos_token_id=0, eos_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        save_tiny(GPT2LMHeadModel(config).eval(), tok, directory)
    return str(directory)


def save_tiny(model, tok, directory) -> None:
    """Save a tiny model made from a config, and its tokenizer, in ``directory``: its matrices
    drawn larger than the init's first (from the global generator), which makes the tiny
    models' predictions less uniform."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)


def save_tiny_llava(directory, seed: int = 0) -> str:
    """Save a tiny LLaVA (a 2-layer CLIP vision tower on 28 x 28 images, 14-pixel patches: 4
    image tokens; a 2-layer Llama) and its processor (a CLIP image processor, the character
    tokenizer with an ``<image>`` token) to ``directory``; open it with
    ``TransformersModel(directory, task="image-text-to-text")``. Needs Pillow."""
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=14,
                               vision_feature_select_strategy="default", image_token="<image>",
                               num_additional_image_tokens=1)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, image_size=28, patch_size=14)
    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                       max_position_embeddings=128, bos_token_id=0, eos_token_id=0,
                       pad_token_id=0)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        save_tiny(LlavaForConditionalGeneration(config).eval(), processor, directory)
    return str(directory)


def save_tiny_diffusion(directory, seed: int = 0) -> str:
    """Save a tiny Stable Diffusion pipeline (a two-level UNet on 8 x 8 latents, a one-level
    VAE, a 2-layer CLIP text encoder, the character tokenizer, a DDIM scheduler) to
    ``directory``; open it with ``DiffusionModel(directory)``. Needs diffusers."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tok = char_tokenizer()
    tok.model_max_length = 16
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
            out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
            norm_num_groups=4, attention_head_dim=4)
        vae = AutoencoderKL(
            block_out_channels=(8,), in_channels=3, out_channels=3, latent_channels=4,
            down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
            norm_num_groups=4, sample_size=8)
        text = CLIPTextModel(CLIPTextConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            vocab_size=len(tok), max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
            pad_token_id=0))
    pipe = StableDiffusionPipeline(unet=unet.eval(), vae=vae.eval(), text_encoder=text.eval(),
                                   tokenizer=tok, scheduler=DDIMScheduler(), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(directory)
    return str(directory)


def char_tokenizer():
    """A small character-level fast tokenizer built in memory (no files, no hub)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<eos>": 0, **{ch: i + 1 for i, ch in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
