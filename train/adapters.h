/* adapters.h — LoRA adapter files in the two layouts people load them with (train.h's
 * adapter_format), written either way and read either way.
 *
 * mlx-lm (mlx_lm.load(MODEL, adapter_path=DIR), mlx_lm.lora --resume-adapter-file):
 *   adapters.safetensors, F32 "<P>layers.N.self_attn.q_proj.lora_a" [in, r] and ".lora_b" [r, out]
 *   for y = W x + scale · (x A) B, where P is how mlx-lm's model class names the text model:
 *   "model." for a text-only checkpoint, "language_model.model." for a multimodal one;
 *   adapter_config.json {"fine_tune_type": "lora", "num_layers", "lora_parameters": {"rank",
 *   "scale", "dropout", "keys"}}.
 * peft (PeftModel.from_pretrained(transformers model, DIR)):
 *   adapter_model.safetensors, F32 "base_model.model.<M>.lora_A.weight" [r, in] = Aᵀ and
 *   ".lora_B.weight" [out, r] = Bᵀ (nn.Linear weights), where M is the module's name in the
 *   transformers class the checkpoint loads as: "model.layers.N.self_attn.q_proj" for a text-only
 *   checkpoint (Gemma4ForCausalLM), "model.language_model.layers.N.self_attn.q_proj" for a
 *   multimodal one (Gemma4ForConditionalGeneration); adapter_config.json with peft_type "LORA",
 *   r, lora_alpha = scale · r (peft scales by lora_alpha / r), target_modules (a list of
 *   projection names plus layers_to_transform for text-only checkpoints; for multimodal ones a
 *   regular expression over the language model's modules, as peft's own Gemma 4 default is, so
 *   the vision and audio towers stay untouched), task_type "CAUSAL_LM".
 * A checkpoint is multimodal when its config.json has a "text_config" object.
 *
 * Reading takes either layout whatever the format option says: the weights' names tell the
 * layout; F32, BF16 or F16 tensors; every slot of the model must be there with its shape, and
 * nothing else may be. Either adapter_config.json gives a lora_config; the trainer adapts the same
 * projections in each of the last num_layers layers, and a peft config that selects anything
 * else is refused. Every failure is -1 with one line naming the file. */
#ifndef WA_TRAIN_ADAPTERS_H
#define WA_TRAIN_ADAPTERS_H

#include "model.h"
#include "train.h" /* adapter_format, lora_config */

#include <stddef.h>

/* "adapters.safetensors" (mlx-lm) or "adapter_model.safetensors" (peft). */
const char *adapters_file_name(adapter_format format);

/* buf = prefix + "layers.N.<projection path>." + suffix: an adapter's name in messages and files
 * (adapter_slot_name(buf, n, "model.", s, "lora_a") is mlx-lm's name in a text-only checkpoint). */
void adapter_slot_name(char *buf, size_t n, const char *prefix, const lora_slot *s, const char *suffix);

/* The adapters of m in format's layout: the weights file and adapter_config.json in dir, each
 * written whole or not at all. model_dir is the checkpoint m was built from (its config.json
 * decides the names; peft's config records it as base_model_name_or_path). */
int adapters_save(const gemma_model_f32 *m, const char *dir, adapter_format format, const char *model_dir, char *err,
                  size_t errlen);
/* The weights alone to path, in format's layout (numbered checkpoints beside the latest). */
int adapters_save_weights(const gemma_model_f32 *m, const char *path, adapter_format format, const char *model_dir,
                          char *err, size_t errlen);

/* The files behind an adapters argument: a folder holding adapters.safetensors or
 * adapter_model.safetensors (its adapter_config.json, if there is one, picks between the two when
 * both are there), or a weights file. weights gets the weights file's path; config the folder's
 * adapter_config.json, or "" for a file or a folder without one (refused when need_config). */
int adapters_locate(const char *path, int need_config, char *weights, size_t weights_len, char *config, size_t config_len,
                    char *err, size_t errlen);

/* Reads A and B for every slot of m from the weights file at path, in either layout (names with
 * mlx-lm's "model.", "language_model.model." or "model.language_model." prefix, or peft's
 * "base_model.model." before those). Every slot must be present with the right shape and finite
 * values, and the file must hold nothing else. m->params changes only on success. */
int adapters_load(gemma_model_f32 *m, const char *path, char *err, size_t errlen);

/* lora_config from an adapter_config.json of either layout, for a model of `layers` layers: mlx-lm's
 * (lora_parameters.keys absent: every projection, as mlx-lm does; num_layers -1, 0 or above the
 * layer count: every layer) or peft's (peft_type "LORA"; scale = lora_alpha / r, or / √r with
 * use_rslora; target_modules, layers_to_transform and layers_pattern matched against the model's
 * module names as peft matches them, and refused unless they select the same projections in
 * each of the last N layers). */
int adapter_config_load(const char *path, int layers, lora_config *lc, char *err, size_t errlen);

#endif
