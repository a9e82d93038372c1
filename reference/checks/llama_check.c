// Cross-check of the model fixtures against llama.cpp (libllama, CPU, F32 KV cache).
//
// Usage: llama_check MODEL.gguf < commands
//   T <hex utf-8 text>          -> prints "T <id,id,...>" (llama_tokenize, no BOS/EOS, no special parsing)
//   E <id,id,...> <out.f32>     -> evaluates the ids at positions 0..T-1 in one batch and writes the
//                                  logits of every position (T x n_vocab float32, little endian)
// API: llama.cpp include/llama.h (llama_model_load_from_file, llama_init_from_model, llama_tokenize,
// llama_batch_init, llama_decode, llama_get_logits_ith).

#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LINE (1 << 20)
#define MAX_TOKENS 4096
#define N_CTX 256

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

static int parse_ids(const char * s, llama_token * ids) {
    int n = 0;
    while (*s && *s != ' ' && *s != '\n' && n < MAX_TOKENS) {
        ids[n++] = (llama_token) strtol(s, (char **) &s, 10);
        if (*s == ',') s++;
    }
    return n;
}

int main(int argc, char ** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL.gguf < commands\n", argv[0]);
        return 2;
    }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    // No repacked (AMX/CPU_REPACK) weight buffers: on AMX hosts attn_k_b (3-D, batched matmul) lands in an
    // AMX buffer that supports no op of the graph and scheduling aborts.
    mp.use_extra_bufts = false;
    struct llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "load failed: %s\n", argv[1]);
        return 1;
    }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    static char line[MAX_LINE];
    static char text[MAX_LINE];
    static llama_token ids[MAX_TOKENS];
    while (fgets(line, sizeof line, stdin)) {
        if (line[0] == 'T') {
            int n = 0;
            for (const char * p = line + 2; hexval(p[0]) >= 0 && hexval(p[1]) >= 0; p += 2) {
                text[n++] = (char) (hexval(p[0]) * 16 + hexval(p[1]));
            }
            int nt = llama_tokenize(vocab, text, n, ids, MAX_TOKENS, false, false);
            printf("T ");
            for (int i = 0; i < nt; i++) printf(i ? ",%d" : "%d", ids[i]);
            printf("\n");
        } else if (line[0] == 'E') {
            int nt = parse_ids(line + 2, ids);
            const char * out = strchr(line + 2, ' ');
            if (!out || nt <= 0) {
                fprintf(stderr, "bad E line\n");
                return 1;
            }
            char path[4096];
            snprintf(path, sizeof path, "%s", out + 1);
            path[strcspn(path, "\n")] = 0;
            struct llama_context_params cp = llama_context_default_params();
            cp.n_ctx = N_CTX;
            cp.n_batch = N_CTX;
            cp.n_ubatch = N_CTX;
            cp.n_seq_max = 1;
            cp.type_k = GGML_TYPE_F32;
            cp.type_v = GGML_TYPE_F32;
            cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
            struct llama_context * ctx = llama_init_from_model(model, cp);
            if (!ctx) {
                fprintf(stderr, "context failed\n");
                return 1;
            }
            struct llama_batch b = llama_batch_init(nt, 0, 1);
            for (int i = 0; i < nt; i++) {
                b.token[i] = ids[i];
                b.pos[i] = i;
                b.n_seq_id[i] = 1;
                b.seq_id[i][0] = 0;
                b.logits[i] = 1;
            }
            b.n_tokens = nt;
            int rc = llama_decode(ctx, b);
            if (rc != 0) {
                fprintf(stderr, "decode failed: %d\n", rc);
                return 1;
            }
            FILE * f = fopen(path, "wb");
            for (int i = 0; i < nt; i++) {
                fwrite(llama_get_logits_ith(ctx, i), sizeof(float), (size_t) n_vocab, f);
            }
            fclose(f);
            printf("E %d %s\n", nt, path);
            llama_batch_free(b);
            llama_free(ctx);
        }
        fflush(stdout);
    }
    llama_model_free(model);
    return 0;
}
