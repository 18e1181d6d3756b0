/* train_yaml.h — `winattn train -c FILE`: mlx-lm's LoRA config file (the keys of mlx-lm's
 * lora_config.yaml and CONFIG_DEFAULTS), read with libyaml and mapped onto train_options; and the
 * reverse, the options written as such a file (`winattn train --print-config`).
 *
 * The file is applied on top of train_defaults and under the command line: cmd_train.c loads it
 * first and then lets every flag override what it set, as mlx-lm's lora.py does. Two settings
 * cannot be applied until the command line is read, and come back in train_file instead: Adam's
 * and AdamW's optimizer_config (mlx-lm uses the entry of whichever optimizer the run ends up
 * with) and whether the file chose iters or epochs (a flag of the other kind replaces it).
 *
 * Every refusal is one line "FILE:LINE: key: problem" in err; an unknown key is refused rather
 * than skipped, because a misspelt key would otherwise train with the default silently. */
#ifndef WA_TOOLS_TRAIN_YAML_H
#define WA_TOOLS_TRAIN_YAML_H

#include "train.h"

#include <stddef.h>
#include <stdio.h>

/* optimizer_config.adam or optimizer_config.adamw: the has_ flags say which the file gave */
typedef struct optimizer_file_settings {
    int has_betas, has_eps, has_weight_decay, has_bias_correction;
    double beta1, beta2, eps, weight_decay;
    int bias_correction;
} optimizer_file_settings;

typedef struct train_file {
    /* the strings the options point into (model_dir, data_dir, out_dir, adapters_path): owned
     * here, released by train_file_free */
    char *model, *data, *adapter_path, *resume_adapter_file;
    int has_iters, has_epochs;
    int eval_only; /* `train: false`: evaluation only, as mlx-lm runs with --test and no --train */
    optimizer_file_settings adam, adamw;
} train_file;

/* Reads the config file at path onto *o (which the caller has set to train_defaults) and *f.
 * 0 on success; -1 with a one-line message naming the file, line and key in err. */
int train_file_load(const char *path, train_options *o, train_file *f, char *err, size_t errlen);

/* Applies optimizer_config's entry for o->adamw's optimizer: each setting the file gave, except
 * weight decay when keep_weight_decay and bias correction when keep_bias_correction (the command
 * line set them). */
void train_file_apply_optimizer(const train_file *f, train_options *o, int keep_weight_decay, int keep_bias_correction);

void train_file_free(train_file *f);

/* Writes *o as a config file train_file_load reads back to the same options (the ones a config
 * file holds: not the device, attention arm, threads, packing or log). 0, or -1 on a write error. */
int train_file_print(FILE *out, const train_options *o);

#endif
