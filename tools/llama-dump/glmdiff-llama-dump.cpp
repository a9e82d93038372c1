// glmdiff-llama-dump: run one prompt through llama.cpp (libllama, CPU or CUDA) and write the activations
// llama.cpp computes as a glmdiff trace (docs/hooks.md): glmdiff's hook names, shapes in PyTorch order,
// F32 values (I32 for the id hooks), and the trace metadata, with the precision llama.cpp computed in.
//
//   glmdiff-llama-dump MODEL.gguf --tokens 1,2,3 --out run.trace.safetensors [options]
//
// How it works: llama.cpp's eval callback (`cb_eval`, as in examples/eval-callback) is asked, before each
// graph node is computed, whether the caller wants that node; the tool answers yes only for the nodes of
// the name map below, so the scheduler stops after each of them and the tool copies its values out
// (ggml_backend_tensor_get: from host or device memory). Node names are llama.cpp's `name-L` (cb() in
// src/llama-graph.cpp, src/models/glm-dsa.cpp, src/models/deepseek2.cpp); one name can label several
// successive nodes of a layer (the pre- and post-RoPE q_pe, the q LoRA's two steps), which the map tells
// apart by the node's operation or order. The map is documented in tools/llama-dump/README.md.

#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"
#include "llama.h"
#include "sha256.h"

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <climits>
#include <cstdarg>
#include <unistd.h>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <map>
#include <new>
#include <stdexcept>
#include <set>
#include <string>
#include <vector>

#ifndef GLMDIFF_LLAMA_COMMIT
#define GLMDIFF_LLAMA_COMMIT "unknown"
#endif

static const char * TOOL_VERSION = "glmdiff-llama-dump 0.1.0";

[[noreturn]] static void die(const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "glmdiff-llama-dump: error: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(2);
}

// ---------------------------------------------------------------------------------------------------
// One captured tensor, in PyTorch order (shape slowest first), F32 or I32.

struct Captured {
    std::vector<int64_t> shape;  // PyTorch order
    std::vector<float> f32;
    std::vector<int32_t> i32;
    bool is_i32 = false;
    std::string op;  // llama.cpp operation that produced it (for the map's rules)
    std::string src; // llama.cpp node name it came from
};

// Reads any (possibly strided) F32/F16/BF16/I32 tensor into a row-major buffer, ggml's dimensions
// reversed (ne[3], ne[2], ne[1], ne[0] → shape [ne3, ne2, ne1, ne0], trailing ones kept for now).
static Captured read_tensor(const ggml_tensor * t) {
    Captured c;
    c.op = ggml_op_name(t->op);
    c.src = t->name;
    const size_t nbytes = ggml_nbytes(t);
    std::vector<uint8_t> raw(nbytes);
    if (t->buffer && !ggml_backend_buffer_is_host(t->buffer)) {
        ggml_backend_tensor_get(t, raw.data(), 0, nbytes);
    } else {
        memcpy(raw.data(), t->data, nbytes);
    }
    c.shape = { t->ne[3], t->ne[2], t->ne[1], t->ne[0] };
    const int64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
    c.is_i32 = t->type == GGML_TYPE_I32;
    if (c.is_i32) {
        c.i32.resize(n);
    } else {
        c.f32.resize(n);
    }
    int64_t k = 0;
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < t->ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < t->ne[1]; i1++) {
                for (int64_t i0 = 0; i0 < t->ne[0]; i0++, k++) {
                    const uint8_t * p = raw.data() + i3 * t->nb[3] + i2 * t->nb[2] + i1 * t->nb[1] + i0 * t->nb[0];
                    switch (t->type) {
                        case GGML_TYPE_F32: {
                            float v;
                            memcpy(&v, p, 4);
                            c.f32[k] = v;
                        } break;
                        case GGML_TYPE_F16: {
                            ggml_fp16_t v;
                            memcpy(&v, p, 2);
                            c.f32[k] = ggml_fp16_to_fp32(v);
                        } break;
                        case GGML_TYPE_BF16: {
                            ggml_bf16_t v;
                            memcpy(&v, p, 2);
                            c.f32[k] = ggml_bf16_to_fp32(v);
                        } break;
                        case GGML_TYPE_I32: {
                            int32_t v;
                            memcpy(&v, p, 4);
                            c.i32[k] = v;
                        } break;
                        default:
                            die("node %s has type %s, which this tool cannot read", t->name, ggml_type_name(t->type));
                    }
                }
            }
        }
    }
    return c;
}

// Reshapes to `want` (same element count, checked); one 0 in `want` takes what is left.
static void reshape(Captured & c, std::vector<int64_t> want, const char * hook) {
    int64_t have = 1, need = 1;
    for (int64_t d : c.shape) have *= d;
    for (int64_t d : want) need *= d ? d : 1;
    if (std::count(want.begin(), want.end(), 0) > 1) die("hook %s: more than one free dimension", hook);
    for (int64_t & d : want)
        if (d == 0) {
            d = need > 0 && have % need == 0 ? have / need : -1;
            need = need * d;
        }
    if (have != need) {
        std::string s;
        for (int64_t d : c.shape) s += std::to_string(d) + " ";
        die("node %s for hook %s has %" PRId64 " values (shape %s), expected %" PRId64, c.src.c_str(), hook, have,
            s.c_str(), need);
    }
    c.shape = want;
}

// Keeps columns [0, keep) of a [rows, cols] tensor.
static void cut_columns(Captured & c, int64_t keep) {
    const int64_t rows = c.shape[0], cols = c.shape[1];
    if (keep >= cols) return;
    if (c.is_i32) {
        std::vector<int32_t> o(rows * keep);
        for (int64_t r = 0; r < rows; r++) std::copy_n(&c.i32[r * cols], keep, &o[r * keep]);
        c.i32.swap(o);
    } else {
        std::vector<float> o(rows * keep);
        for (int64_t r = 0; r < rows; r++) std::copy_n(&c.f32[r * cols], keep, &o[r * keep]);
        c.f32.swap(o);
    }
    c.shape[1] = keep;
}

// ---------------------------------------------------------------------------------------------------
// The capture: which llama.cpp nodes are wanted, and every occurrence of them in graph order.

struct State {
    int64_t n_tokens = 0;
    std::set<std::string> wanted;  // base names (without -L)
    // (base name, layer) → occurrences in graph order; layer -1 for global nodes
    std::map<std::pair<std::string, int>, std::vector<Captured>> seen;
    // attn_output's product has no name of its own: it is the matrix product that reads kqv_out-L
    std::map<const ggml_tensor *, int> kqv_out;
    std::map<int, Captured> attn_out;
    bool interrupted = false;
    // flash attention as llama.cpp resolved it (a FLASH_ATTN_EXT node was computed), and whether that
    // node ran on the CPU (a head size the GPU backend has no kernel for)
    bool fa_seen = false, fa_on_cpu = false;
};

static volatile sig_atomic_t g_interrupted = 0;

// The first Ctrl-C stops the run at the next node (and nothing is written); a second one kills.
static void on_signal(int sig) {
    g_interrupted = 1;
    signal(sig, SIG_DFL);
}

static bool split_name(const char * name, std::string & base, int & layer) {
    const char * dash = strrchr(name, '-');
    if (dash && dash[1] != '\0') {
        char * end = nullptr;
        long l = strtol(dash + 1, &end, 10);
        if (end && *end == '\0') {
            base.assign(name, dash - name);
            layer = (int) l;
            return true;
        }
    }
    base = name;
    layer = -1;
    return true;
}

// Size filters for names that also label large intermediates: indexer_score is taken only as the
// [n_kv, T] matrix of masked scores (not the per-head [heads, n_kv, T] products).
// Views of names that label a computed twin (the pre-RoPE q_pe and k_pe, the un-normed kv_cmpr, the
// reshaped q) are not kept: they are never a hook.
static bool shape_ok(const std::string & base, const ggml_tensor * t, int64_t n_tokens) {
    if (base == "indexer_score") {
        return t->ne[1] == n_tokens && t->ne[2] == 1 && t->ne[3] == 1 && t->ne[0] >= n_tokens;
    }
    if (base == "q_pe" || base == "k_pe" || base == "kv_cmpr" || base == "q" || base == "qr") {
        return t->op != GGML_OP_VIEW && t->op != GGML_OP_RESHAPE && t->op != GGML_OP_PERMUTE;
    }
    return true;
}

static bool eval_cb(ggml_tensor * t, bool ask, void * user) {
    State * s = (State *) user;
    if (g_interrupted) {
        s->interrupted = true;
        return false;  // (answered to the data call) stops the graph's computation
    }
    if (ask && t->op == GGML_OP_FLASH_ATTN_EXT) {
        s->fa_seen = true;
        if (!t->buffer || ggml_backend_buffer_is_host(t->buffer)) s->fa_on_cpu = true;
    }
    std::string base;
    int layer;
    split_name(t->name, base, layer);
    if (base == "kqv_out" && layer >= 0) s->kqv_out[t] = layer;
    int wo_layer = -1;
    if (t->op == GGML_OP_MUL_MAT && t->src[1]) {
        auto it = s->kqv_out.find(t->src[1]);
        if (it != s->kqv_out.end()) wo_layer = it->second;
    }
    const bool want = wo_layer >= 0 || (s->wanted.count(base) > 0 && shape_ok(base, t, s->n_tokens));
    if (ask) return want;
    if (!want) return true;
    if (wo_layer >= 0) {
        s->attn_out[wo_layer] = read_tensor(t);
    } else {
        s->seen[{ base, layer }].push_back(read_tensor(t));
    }
    return !g_interrupted;
}

// ---------------------------------------------------------------------------------------------------
// safetensors writer (https://github.com/huggingface/safetensors: 8-byte little-endian header length,
// JSON header, raw little-endian data).

static std::string json_escape(const std::string & s) {
    std::string o;
    for (unsigned char c : s) {
        switch (c) {
            case '"': o += "\\\""; break;
            case '\\': o += "\\\\"; break;
            case '\n': o += "\\n"; break;
            case '\r': o += "\\r"; break;
            case '\t': o += "\\t"; break;
            default:
                if (c < 0x20) {
                    char b[8];
                    snprintf(b, sizeof b, "\\u%04x", c);
                    o += b;
                } else {
                    o += (char) c;
                }
        }
    }
    return o;
}

static std::string g_tmp_path;

static void remove_tmp() {
    if (!g_tmp_path.empty()) remove(g_tmp_path.c_str());
}

static void write_safetensors(const std::string & path, const std::map<std::string, Captured> & tensors,
                              const std::vector<std::pair<std::string, std::string>> & meta) {
    std::string h = "{\"__metadata__\":{";
    for (size_t i = 0; i < meta.size(); i++) {
        if (i) h += ",";
        h += "\"" + json_escape(meta[i].first) + "\":\"" + json_escape(meta[i].second) + "\"";
    }
    h += "}";
    uint64_t off = 0;
    for (const auto & [name, c] : tensors) {
        uint64_t n = c.is_i32 ? c.i32.size() : c.f32.size();
        h += ",\"" + json_escape(name) + "\":{\"dtype\":\"" + (c.is_i32 ? "I32" : "F32") + "\",\"shape\":[";
        for (size_t d = 0; d < c.shape.size(); d++) {
            if (d) h += ",";
            h += std::to_string(c.shape[d]);
        }
        h += "],\"data_offsets\":[" + std::to_string(off) + "," + std::to_string(off + 4 * n) + "]}";
        off += 4 * n;
    }
    h += "}";
    while (h.size() % 8) h += ' ';
    g_tmp_path = path + ".tmp-" + std::to_string((long) getpid());
    FILE * f = fopen(g_tmp_path.c_str(), "wb");
    if (!f) die("cannot create %s: %s", g_tmp_path.c_str(), strerror(errno));
    uint64_t hl = h.size();
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t) (hl >> (8 * i));
    bool ok = fwrite(le, 1, 8, f) == 8 && fwrite(h.data(), 1, h.size(), f) == h.size();
    for (const auto & [name, c] : tensors) {
        if (!ok || g_interrupted) break;
        if (c.is_i32) {
            ok = fwrite(c.i32.data(), 4, c.i32.size(), f) == c.i32.size();
        } else {
            ok = fwrite(c.f32.data(), 4, c.f32.size(), f) == c.f32.size();
        }
    }
    ok = (fclose(f) == 0) && ok;
    if (g_interrupted) {
        remove_tmp();
        die("interrupted; nothing written");
    }
    if (!ok) {
        remove_tmp();
        die("writing %s failed: %s", path.c_str(), strerror(errno));
    }
    if (rename(g_tmp_path.c_str(), path.c_str()) != 0) {
        remove_tmp();
        die("cannot rename %s to %s: %s", g_tmp_path.c_str(), path.c_str(), strerror(errno));
    }
    g_tmp_path.clear();
}

// ---------------------------------------------------------------------------------------------------
// Command line.

struct Args {
    std::string model, out, prompt;
    std::vector<llama_token> tokens;
    std::string kv_type = "f16";
    std::string flash_attn = "off";
    int gpu_layers = 0;
    int threads = 0;
    std::vector<std::string> overrides;
};

static void usage() {
    fprintf(stderr,
            "usage: glmdiff-llama-dump MODEL.gguf (--tokens ID,ID,... | --prompt TEXT) --out TRACE.safetensors\n"
            "         [--kv-type f16|f32|bf16|q8_0] [--flash-attn off|on|auto] [--gpu-layers N] [--threads N]\n"
            "         [--override-kv KEY=TYPE:VALUE]...\n"
            "Runs the prompt through llama.cpp in one batch and writes its activations under glmdiff's hook\n"
            "names (glmdiff docs/hooks.md). --kv-type: llama.cpp's KV cache type (llama.cpp's default f16).\n"
            "--gpu-layers: layers offloaded to the GPU (-1: all) in a CUDA build. --override-kv: llama.cpp's\n"
            "metadata override, TYPE int|float|bool|str (as llama.cpp's --override-kv).\n");
}

static std::vector<llama_token> parse_tokens(const char * s) {
    std::vector<llama_token> ids;
    const char * p = s;
    while (*p) {
        char * end = nullptr;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX) die("--tokens: cannot read a token id at \"%s\"", p);
        ids.push_back((llama_token) v);
        p = end;
        if (*p == ',') p++;
        else if (*p) die("--tokens: expected ',' at \"%s\"", p);
    }
    if (ids.empty()) die("--tokens: no token ids");
    return ids;
}

static int parse_int(const std::string & flag, const char * v, long lo) {
    char * end = nullptr;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (end == v || *end != '\0' || errno || x < lo || x > INT32_MAX) die("%s %s: expected an integer >= %ld", flag.c_str(), v, lo);
    return (int) x;
}

static ggml_type kv_type_of(const std::string & s);

static Args parse_args(int argc, char ** argv) {
    Args a;
    for (int i = 1; i < argc; i++) {
        std::string k = argv[i];
        auto val = [&]() -> const char * {
            if (i + 1 >= argc) die("%s needs a value", k.c_str());
            return argv[++i];
        };
        if (k == "--tokens") a.tokens = parse_tokens(val());
        else if (k == "--prompt") a.prompt = val();
        else if (k == "--out") a.out = val();
        else if (k == "--kv-type") a.kv_type = val();
        else if (k == "--flash-attn") a.flash_attn = val();
        else if (k == "--gpu-layers") a.gpu_layers = parse_int(k, val(), -1);
        else if (k == "--threads") a.threads = parse_int(k, val(), 1);
        else if (k == "--override-kv") a.overrides.push_back(val());
        else if (k == "-h" || k == "--help") {
            usage();
            exit(0);
        } else if (!k.empty() && k[0] == '-') die("unknown option %s (--help lists them)", k.c_str());
        else if (a.model.empty()) a.model = k;
        else die("unexpected argument %s", k.c_str());
    }
    if (a.model.empty() || a.out.empty() || (a.tokens.empty() && a.prompt.empty())) {
        usage();
        exit(2);
    }
    if (!a.tokens.empty() && !a.prompt.empty()) die("give --tokens or --prompt, not both");
    kv_type_of(a.kv_type);  // checked before the (long) model load
    if (a.flash_attn != "on" && a.flash_attn != "off" && a.flash_attn != "auto")
        die("--flash-attn %s: expected off, on or auto", a.flash_attn.c_str());
    return a;
}

static ggml_type kv_type_of(const std::string & s) {
    if (s == "f16") return GGML_TYPE_F16;
    if (s == "f32") return GGML_TYPE_F32;
    if (s == "bf16") return GGML_TYPE_BF16;
    if (s == "q8_0") return GGML_TYPE_Q8_0;
    die("--kv-type %s: expected f16, f32, bf16 or q8_0", s.c_str());
}

static llama_model_kv_override parse_override(const std::string & s) {
    // KEY=TYPE:VALUE, as llama.cpp's common/arg.cpp string_parse_kv_override
    llama_model_kv_override o;
    memset(&o, 0, sizeof o);
    size_t eq = s.find('='), colon = s.find(':', eq == std::string::npos ? 0 : eq);
    if (eq == std::string::npos || colon == std::string::npos || eq == 0 || eq >= sizeof o.key)
        die("--override-kv %s: expected KEY=TYPE:VALUE (TYPE int, float, bool or str)", s.c_str());
    memcpy(o.key, s.data(), eq);
    std::string ty = s.substr(eq + 1, colon - eq - 1), v = s.substr(colon + 1);
    char * end = nullptr;
    if (ty == "int") {
        o.tag = LLAMA_KV_OVERRIDE_TYPE_INT;
        o.val_i64 = strtoll(v.c_str(), &end, 10);
    } else if (ty == "float") {
        o.tag = LLAMA_KV_OVERRIDE_TYPE_FLOAT;
        o.val_f64 = strtod(v.c_str(), &end);
    } else if (ty == "bool") {
        o.tag = LLAMA_KV_OVERRIDE_TYPE_BOOL;
        if (v != "true" && v != "false") die("--override-kv %s: bool value must be true or false", s.c_str());
        o.val_bool = v == "true";
        return o;
    } else if (ty == "str") {
        o.tag = LLAMA_KV_OVERRIDE_TYPE_STR;
        if (v.size() >= sizeof o.val_str) die("--override-kv %s: string too long", s.c_str());
        memcpy(o.val_str, v.data(), v.size());
        return o;
    } else {
        die("--override-kv %s: type %s is not int, float, bool or str", s.c_str(), ty.c_str());
    }
    if (!end || *end != '\0' || v.empty()) die("--override-kv %s: cannot read the value %s", s.c_str(), v.c_str());
    return o;
}

// ---------------------------------------------------------------------------------------------------
// What the GGUF says about precision: the weight types llama.cpp multiplies with.

struct WeightTypes {
    std::map<std::string, ggml_type> type_of;  // every tensor's type
    std::set<std::string> keys;                // every metadata key
    uint32_t index_topk = 0;
    std::string arch;
    std::vector<std::string> shards;           // the model's files: the first shard, then the others
};

static WeightTypes weight_types(const std::string & path) {
    WeightTypes w;
    gguf_init_params p = { /*no_alloc*/ true, /*ctx*/ nullptr };
    gguf_context * g = gguf_init_from_file(path.c_str(), p);
    if (!g) die("%s: not a GGUF file llama.cpp can read", path.c_str());
    int64_t ak = gguf_find_key(g, "general.architecture");
    if (ak >= 0 && gguf_get_kv_type(g, ak) == GGUF_TYPE_STRING) w.arch = gguf_get_val_str(g, ak);
    int64_t tk = gguf_find_key(g, (w.arch + ".attention.indexer.top_k").c_str());
    if (tk >= 0 && gguf_get_kv_type(g, tk) == GGUF_TYPE_UINT32) w.index_topk = gguf_get_val_u32(g, tk);
    for (int64_t i = 0; i < gguf_get_n_kv(g); i++) w.keys.insert(gguf_get_key(g, i));
    for (int64_t i = 0; i < gguf_get_n_tensors(g); i++) w.type_of[gguf_get_tensor_name(g, i)] = gguf_get_tensor_type(g, i);
    // a split model (NAME-00001-of-0000N.gguf): llama.cpp opens the first shard and finds the others;
    // every shard's tensor types are read, for the precision of every layer
    int64_t ck = gguf_find_key(g, "split.count"), nk = gguf_find_key(g, "split.no");
    int count = ck >= 0 && gguf_get_kv_type(g, ck) == GGUF_TYPE_UINT16 ? gguf_get_val_u16(g, ck) : 1;
    int no = nk >= 0 && gguf_get_kv_type(g, nk) == GGUF_TYPE_UINT16 ? gguf_get_val_u16(g, nk) : 0;
    gguf_free(g);
    w.shards.push_back(path);
    if (count > 1) {
        if (no != 0) die("%s is shard %d of %d: give the first shard (llama.cpp loads the others from it)", path.c_str(), no + 1, count);
        char prefix[4096], shard[4096];
        if (!llama_split_prefix(prefix, sizeof prefix, path.c_str(), 0, count))
            die("%s: a split model (split.count %d) whose name is not NAME-00001-of-%05d.gguf", path.c_str(), count, count);
        for (int i = 1; i < count; i++) {
            llama_split_path(shard, sizeof shard, prefix, i, count);
            gguf_context * s = gguf_init_from_file(shard, p);
            if (!s) die("%s: shard %d of %d, %s, is missing or not a GGUF file", path.c_str(), i + 1, count, shard);
            for (int64_t j = 0; j < gguf_get_n_tensors(s); j++) w.type_of[gguf_get_tensor_name(s, j)] = gguf_get_tensor_type(s, j);
            gguf_free(s);
            w.shards.push_back(shard);
        }
    }
    return w;
}

// ---------------------------------------------------------------------------------------------------
// Which model file the trace was made from, by content: the metadata `model_digest` (glmdiff
// docs/hooks.md). Each listed tensor's entry is the SHA-256 of its name, a 0 byte, its GGML type id
// (u32 LE), its number of dimensions (u32 LE), each dimension in GGUF order (u64 LE), its data size
// in bytes (u64 LE) and the first min(size, 1 MiB) bytes of its data as stored in the file (the raw
// blocks). Listed: token_embd.weight, output_norm.weight, output.weight when present, every tensor of
// block 0 and of the first block with a router (blk.N.ffn_gate_inp.weight). Read from the GGUF files
// themselves, each tensor from the shard that holds it, not from llama.cpp's loaded weights.

static const uint64_t DIGEST_PREFIX_BYTES = 1 << 20;

// The number of dimensions each tensor info record of a GGUF stores, in file order. ggml's gguf API
// pads every shape to 4 dimensions and keeps no n_dims (a file written by gguf-py may store trailing
// dimensions of 1, which ggml_n_dims would drop), so the header is walked here: magic, version,
// tensor count, key count, the key-value pairs (skipped), then per tensor its name, n_dims, ne[n_dims],
// type and offset.
struct StoredInfo {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type = 0;
};

static std::vector<StoredInfo> gguf_stored_infos(const std::string & path) {
    FILE * f = fopen(path.c_str(), "rb");
    if (!f) die("%s: cannot open for the model digest: %s", path.c_str(), strerror(errno));
    auto fail = [&](const char * what) {
        const bool eof = feof(f);
        fclose(f);
        die("%s: reading the GGUF header for the model digest failed at %s: %s", path.c_str(), what,
            eof ? "unexpected end of file" : strerror(errno));
    };
    auto u32 = [&](const char * what) {
        uint8_t b[4];
        if (fread(b, 1, 4, f) != 4) fail(what);
        return (uint32_t) b[0] | (uint32_t) b[1] << 8 | (uint32_t) b[2] << 16 | (uint32_t) b[3] << 24;
    };
    auto u64 = [&](const char * what) {
        uint8_t b[8];
        if (fread(b, 1, 8, f) != 8) fail(what);
        uint64_t v = 0;
        for (int i = 7; i >= 0; i--) v = v << 8 | b[i];
        return v;
    };
    auto skip = [&](uint64_t n, const char * what) {
        if (n > (uint64_t) INT64_MAX || fseeko(f, (off_t) n, SEEK_CUR) != 0) fail(what);
    };
    auto str = [&](const char * what) {
        uint64_t n = u64(what);
        if (n > (1u << 20)) fail(what);  // a tensor name (ggml's are under GGML_MAX_NAME bytes)
        std::string s(n, '\0');
        if (n && fread(&s[0], 1, n, f) != n) fail(what);
        return s;
    };
    // bytes of one value of a fixed-size GGUF type (GGUF_TYPE_*), 0 for strings and arrays
    auto fixed = [](uint32_t t) -> uint64_t {
        switch (t) {
            case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
            case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
            case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
            case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
            default: return 0;
        }
    };
    char magic[4];
    if (fread(magic, 1, 4, f) != 4 || memcmp(magic, "GGUF", 4) != 0) fail("the magic");
    const uint32_t version = u32("the version");
    if (version < 2) fail("the version (GGUF v1 has no 64-bit counts)");
    const uint64_t n_tensors = u64("the tensor count"), n_kv = u64("the key count");
    for (uint64_t i = 0; i < n_kv; i++) {
        skip(u64("a key length"), "a key");
        const uint32_t t = u32("a value type");
        if (fixed(t)) {
            skip(fixed(t), "a value");
        } else if (t == GGUF_TYPE_STRING) {
            skip(u64("a string length"), "a string");
        } else if (t == GGUF_TYPE_ARRAY) {
            const uint32_t et = u32("an array type");
            const uint64_t n = u64("an array length");
            if (fixed(et)) {
                if (n > UINT64_MAX / fixed(et)) fail("an array length");
                skip(n * fixed(et), "an array");
            } else if (et == GGUF_TYPE_STRING) {
                for (uint64_t j = 0; j < n; j++) skip(u64("a string length"), "a string");
            } else {
                fail("an array of an unknown type");
            }
        } else {
            fail("a value of an unknown type");
        }
    }
    std::vector<StoredInfo> infos;
    for (uint64_t i = 0; i < n_tensors; i++) {
        StoredInfo s;
        s.name = str("a tensor name");
        const uint32_t n_dims = u32("a tensor's n_dims");
        if (n_dims == 0 || n_dims > GGML_MAX_DIMS) fail("a tensor's n_dims");
        for (uint32_t d = 0; d < n_dims; d++) s.ne.push_back(u64("a tensor's dimensions"));
        s.type = u32("a tensor's type");
        u64("a tensor's offset");
        infos.push_back(std::move(s));
    }
    fclose(f);
    return infos;
}

// One tensor of the model: where its data lies and what the digest lays out before it.
struct ModelTensor {
    std::string name;
    size_t shard = 0;           // index into the shard list
    uint32_t type = 0;          // GGML type id
    std::vector<uint64_t> ne;   // the dimensions the file stores, ne[0] first
    uint64_t nbytes = 0;        // ggml_nbytes
    uint64_t offset = 0;        // of its data in the shard file (data section start + tensor offset)
};

static std::string model_digest(const std::vector<std::string> & shards) {
    std::vector<ModelTensor> tensors;
    std::map<std::string, size_t> index;  // name → its first occurrence
    for (size_t si = 0; si < shards.size(); si++) {
        const std::string & path = shards[si];
        gguf_init_params p = { /*no_alloc*/ true, /*ctx*/ nullptr };
        gguf_context * g = gguf_init_from_file(path.c_str(), p);
        if (!g) die("%s: not a GGUF file llama.cpp can read", path.c_str());
        const std::vector<StoredInfo> stored = gguf_stored_infos(path);
        const int64_t n = gguf_get_n_tensors(g);
        if ((int64_t) stored.size() != n)
            die("%s: its header lists %zu tensors, ggml's reader %" PRId64, path.c_str(), stored.size(), n);
        const uint64_t data = gguf_get_data_offset(g);
        for (int64_t i = 0; i < n; i++) {
            ModelTensor t;
            t.name = gguf_get_tensor_name(g, i);
            t.shard = si;
            t.type = (uint32_t) gguf_get_tensor_type(g, i);
            t.nbytes = gguf_get_tensor_size(g, i);
            t.offset = data + gguf_get_tensor_offset(g, i);
            t.ne = stored[i].ne;
            // the walk above and ggml's reader must agree (ggml pads the shape with ones)
            const int64_t * ne = gguf_get_tensor_ne(g, i);
            bool same = stored[i].name == t.name && stored[i].type == t.type;
            for (int d = 0; d < GGML_MAX_DIMS; d++)
                same = same && (uint64_t) ne[d] == (d < (int) t.ne.size() ? t.ne[d] : 1);
            if (!same) die("%s: tensor %" PRId64 " (%s): the header walk and ggml's reader disagree", path.c_str(), i, t.name.c_str());
            if (!index.count(t.name)) index[t.name] = tensors.size();
            tensors.push_back(std::move(t));
        }
        gguf_free(g);
    }
    // the first MoE block: the smallest N with a tensor blk.N.ffn_gate_inp.weight
    const std::string pre = "blk.", suf = ".ffn_gate_inp.weight";
    bool have_moe = false;
    uint64_t first_moe = 0;
    for (const auto & t : tensors) {
        if (t.name.size() <= pre.size() + suf.size() || t.name.compare(0, pre.size(), pre) != 0 ||
            t.name.compare(t.name.size() - suf.size(), suf.size(), suf) != 0)
            continue;
        const std::string num = t.name.substr(pre.size(), t.name.size() - pre.size() - suf.size());
        if (num.size() > 19 || num.find_first_not_of("0123456789") != std::string::npos) continue;
        const uint64_t b = strtoull(num.c_str(), nullptr, 10);
        if (!have_moe || b < first_moe) first_moe = b;
        have_moe = true;
    }
    std::vector<std::string> blocks = { "blk.0." };
    if (have_moe) blocks.push_back("blk." + std::to_string(first_moe) + ".");
    std::map<std::string, std::string> digests;  // name → hex (JSON key order: by name)
    std::vector<int> fds(shards.size(), -1);
    std::vector<uint8_t> buf;
    for (const auto & [name, ti] : index) {
        bool listed = name == "token_embd.weight" || name == "output_norm.weight" || name == "output.weight";
        for (const auto & b : blocks) listed = listed || name.compare(0, b.size(), b) == 0;
        if (!listed) continue;
        if (g_interrupted) die("interrupted; nothing written");
        const ModelTensor & t = tensors[ti];
        const std::string & path = shards[t.shard];
        if (fds[t.shard] < 0) {
            fds[t.shard] = open(path.c_str(), O_RDONLY);
            if (fds[t.shard] < 0) die("%s: cannot open for the model digest: %s", path.c_str(), strerror(errno));
        }
        const uint64_t want = std::min(t.nbytes, DIGEST_PREFIX_BYTES);
        buf.resize(want);
        uint64_t got = 0;
        while (got < want) {
            const ssize_t r = pread(fds[t.shard], buf.data() + got, want - got, (off_t) (t.offset + got));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0)
                die("%s: tensor %s: reading its data for the model digest (%" PRIu64 " bytes at offset %" PRIu64 ") failed: %s",
                    path.c_str(), name.c_str(), want, t.offset, r < 0 ? strerror(errno) : "the file ends before it (truncated?)");
            got += (uint64_t) r;
        }
        Sha256 h;
        h.update(name.data(), name.size());
        const uint8_t zero = 0;
        h.update(&zero, 1);
        h.update_u32le(t.type);
        h.update_u32le((uint32_t) t.ne.size());
        for (uint64_t d : t.ne) h.update_u64le(d);
        h.update_u64le(t.nbytes);
        h.update(buf.data(), want);
        digests[name] = h.hex();
    }
    for (int fd : fds)
        if (fd >= 0) close(fd);
    if (digests.empty()) die("%s: none of the tensors the model digest lists (token_embd.weight, output_norm.weight, blk.0.*)", shards[0].c_str());
    std::string j = "{\"algorithm\":\"sha256\",\"prefix_bytes\":" + std::to_string(DIGEST_PREFIX_BYTES) + ",\"tensors\":{";
    bool first = true;
    for (const auto & [name, hex] : digests) {
        j += (first ? "\"" : ",\"") + json_escape(name) + "\":\"" + hex + "\"";
        first = false;
    }
    return j + "}}";
}

// ---------------------------------------------------------------------------------------------------

// The operand formats and sums of the matrix products of one step, by the weights' types and the
// backend (documented in tools/llama-dump/README.md, "Precision"):
// - CPU (ggml-cpu): the activations are rounded to the weight's vec_dot_type: F32 for F32, F16 for
//   F16, BF16 for BF16, an 8-bit block format for quantized types; sums in f32.
// - CUDA (ggml-cuda): F32 weights run on tensor cores in TF32 (its cuBLAS handles are set to
//   CUBLAS_TF32_TENSOR_OP_MATH, its small-batch kernel uses tf32 mma); F16 weights through cuBLAS's
//   CUBLAS_COMPUTE_16F (f16 sums and output); BF16 with f32 sums; quantized weights through MMQ
//   with q8_1 activations.
struct Operands {
    bool cuda = false;
    int products = 0;  // 0 f32, 1 tf32, 2 f16, 3 bf16: the coarsest wins (tf32 and f16 both 2^-11)
    bool acc16 = false;
    bool q8 = false;
    bool any = false;  // some weight of the step was found
    void rank(int r) { products = std::max(products, r); }
    void add(ggml_type t) {
        any = true;
        if (t == GGML_TYPE_F32) {
            if (cuda) rank(1);
        } else if (t == GGML_TYPE_F16) {
            rank(2);
            if (cuda) acc16 = true;
        } else if (t == GGML_TYPE_BF16) {
            rank(3);
        } else if (t != GGML_TYPE_I32) {
            q8 = true;
        }
    }
    std::string text() const {
        static const char * names[] = { "", "tf32", "f16", "bf16" };
        std::string d = std::string("f32 storage, ") + (acc16 ? "f16" : "f32") + " accumulation";
        if (products) d += std::string(", ") + names[products] + " products";
        if (q8) d += ", q8 activations";
        return d;
    }
};

// ---------------------------------------------------------------------------------------------------

static std::string base_name(const std::string & p) {
    size_t s = p.find_last_of('/');
    return s == std::string::npos ? p : p.substr(s + 1);
}

static int run(int argc, char ** argv);

int main(int argc, char ** argv) {
    try {
        return run(argc, argv);
    } catch (const std::bad_alloc &) {
        remove_tmp();
        die("out of host memory while holding the captured activations (a shorter prompt needs less)");
    } catch (const std::exception & e) {
        remove_tmp();
        die("%s", e.what());
    }
}

static int run(int argc, char ** argv) {
    Args a = parse_args(argc, argv);
    {
        FILE * f = fopen(a.model.c_str(), "rb");
        if (!f) die("cannot open model %s: %s", a.model.c_str(), strerror(errno));
        fclose(f);
    }
    char rm[PATH_MAX], ro[PATH_MAX];
    if (realpath(a.model.c_str(), rm)) {
        // the output file may not exist yet: compare its directory's real path + name
        std::string dir = a.out.substr(0, a.out.find_last_of('/') == std::string::npos ? 0 : a.out.find_last_of('/'));
        if (realpath(dir.empty() ? "." : dir.c_str(), ro)) {
            std::string outreal = std::string(ro) + "/" + base_name(a.out);
            if (outreal == rm) die("--out %s is the model file: refusing to overwrite an input", a.out.c_str());
        }
    }
    {
        // the output's directory must exist and be writable before the (long) run
        size_t slash = a.out.find_last_of('/');
        std::string dir = slash == std::string::npos ? "." : a.out.substr(0, slash == 0 ? 1 : slash);
        if (access(dir.c_str(), W_OK) != 0) die("--out %s: directory %s is not writable: %s", a.out.c_str(), dir.c_str(), strerror(errno));
    }
    signal(SIGINT, on_signal);
    signal(SIGTERM, on_signal);

    WeightTypes wt = weight_types(a.model);
    if (wt.arch != "glm-dsa" && wt.arch != "deepseek2")
        die("%s: architecture %s; this tool maps llama.cpp's glm-dsa and deepseek2 graphs only", a.model.c_str(),
            wt.arch.c_str());
    // read from the GGUF files before llama.cpp loads them (a few MiB at most)
    const std::string digest = model_digest(wt.shards);

    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level >= GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
    }, nullptr);
    llama_backend_init();

    std::vector<llama_model_kv_override> ov;
    for (const auto & s : a.overrides) ov.push_back(parse_override(s));
    if (!ov.empty()) {
        llama_model_kv_override end;
        memset(&end, 0, sizeof end);
        ov.push_back(end);  // the list ends with an empty key
    }

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = a.gpu_layers;
    // no repacked (AMX/CPU_REPACK) weight buffers: on AMX hosts attn_k_b (3-D, batched matmul) lands in a
    // buffer that supports no op of the graph and scheduling aborts
    mp.use_extra_bufts = false;
    mp.kv_overrides = ov.empty() ? nullptr : ov.data();
    for (size_t i = 0; i + 1 < ov.size(); i++)
        if (!wt.keys.count(ov[i].key))
            fprintf(stderr, "glmdiff-llama-dump: warning: --override-kv %s: %s has no such key; llama.cpp applies it only if it reads that key\n",
                    ov[i].key, a.model.c_str());
    mp.progress_callback = [](float, void *) { return !g_interrupted; };
    fprintf(stderr, "glmdiff-llama-dump: loading %s\n", a.model.c_str());
    llama_model * model = llama_model_load_from_file(a.model.c_str(), mp);
    if (g_interrupted) die("interrupted; nothing written");
    if (!model) die("llama.cpp could not load %s (its log above says why)", a.model.c_str());
    const llama_vocab * vocab = llama_model_get_vocab(model);

    if (!a.prompt.empty()) {
        int n = -llama_tokenize(vocab, a.prompt.c_str(), (int) a.prompt.size(), nullptr, 0, false, false);
        a.tokens.resize(n);
        if (n <= 0) die("--prompt %s: no tokens", a.prompt.c_str());
        if (llama_tokenize(vocab, a.prompt.c_str(), (int) a.prompt.size(), a.tokens.data(), n, false, false) != n)
            die("tokenizing the prompt failed");
    }
    const int n_vocab = llama_vocab_n_tokens(vocab);
    for (size_t i = 0; i < a.tokens.size(); i++)
        if (a.tokens[i] >= n_vocab) die("token %d (position %zu) is not below the vocabulary size %d", a.tokens[i], i, n_vocab);
    const int64_t T = (int64_t) a.tokens.size();

    State st;
    st.n_tokens = T;
    st.wanted = { "embd", "attn_norm", "qr", "q", "q_pe", "k_pe", "kv_cmpr_pe", "kv_cmpr", "indexer_score",
                  "top_k", "kqv_out", "ffn_inp", "ffn_norm", "ffn_gate", "ffn_up", "ffn_swiglu", "ffn_out",
                  "ffn_moe_logits", "ffn_moe_probs", "ffn_moe_topk", "ffn_moe_weights", "ffn_moe_weights_norm",
                  "ffn_moe_weights_scaled", "ffn_moe_out", "ffn_shexp", "l_out", "result_norm", "result_output" };

    llama_context_params cp = llama_context_default_params();
    const uint32_t n_ctx = (uint32_t) ((T + 255) / 256 * 256);
    cp.n_ctx = n_ctx;
    cp.n_batch = n_ctx;
    cp.n_ubatch = n_ctx;  // one ubatch: every node holds all T rows
    cp.n_seq_max = 1;
    if (a.threads > 0) cp.n_threads = cp.n_threads_batch = a.threads;
    cp.type_k = cp.type_v = kv_type_of(a.kv_type);
    if (a.flash_attn == "on") cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    else if (a.flash_attn == "off") cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    else if (a.flash_attn == "auto") cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_AUTO;
    else die("--flash-attn %s: expected off, on or auto", a.flash_attn.c_str());
    // a CPU run stays on the CPU (a CUDA build otherwise offloads large products of host weights)
    if (a.gpu_layers == 0) cp.op_offload = false;
    cp.abort_callback = [](void *) { return (bool) g_interrupted; };
    cp.cb_eval = eval_cb;
    cp.cb_eval_user_data = &st;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) die("llama.cpp could not create a context for %s (its log above says why)", a.model.c_str());

    llama_batch batch = llama_batch_init((int32_t) T, 0, 1);
    for (int64_t i = 0; i < T; i++) {
        batch.token[i] = a.tokens[i];
        batch.pos[i] = (llama_pos) i;
        batch.n_seq_id[i] = 1;
        batch.seq_id[i][0] = 0;
        batch.logits[i] = 1;  // every row's logits: the last layer keeps all rows
    }
    batch.n_tokens = (int32_t) T;
    fprintf(stderr, "glmdiff-llama-dump: running %" PRId64 " tokens through %d layers (%s KV cache, flash attention %s)\n", T,
            llama_model_n_layer(model), a.kv_type.c_str(), a.flash_attn.c_str());
    int rc = llama_decode(ctx, batch);
    if (st.interrupted || g_interrupted) die("interrupted; nothing written");
    if (rc != 0) die("llama_decode failed (%d) on %s", rc, a.model.c_str());

    // ---- map llama.cpp's nodes to glmdiff's hooks
    const int n_layer = llama_model_n_layer(model);
    char buf[256];
    auto meta_u32 = [&](const std::string & key, int64_t dflt) -> int64_t {
        if (llama_model_meta_val_str(model, (wt.arch + "." + key).c_str(), buf, sizeof buf) < 0) return dflt;
        return strtoll(buf, nullptr, 10);
    };
    const int64_t n_embd = llama_model_n_embd(model);
    const int64_t n_head = meta_u32("attention.head_count", 0);
    const int64_t q_lora = meta_u32("attention.q_lora_rank", 0);
    const int64_t rope = meta_u32("rope.dimension_count", 0);
    const int64_t n_run = n_layer;
    const int64_t n_dense = meta_u32("leading_dense_block_count", 0);
    const int64_t n_expert = meta_u32("expert_count", 0);  // llama_model_n_layer leaves the MTP (nextn) blocks out

    std::map<std::string, Captured> out;
    std::map<std::string, std::string> not_captured;
    auto occ = [&](const std::string & base, int layer) -> std::vector<Captured> * {
        auto it = st.seen.find({ base, layer });
        return it == st.seen.end() ? nullptr : &it->second;
    };
    auto put = [&](const std::string & hook, Captured && c, std::vector<int64_t> shape) {
        reshape(c, shape, hook.c_str());
        out[hook] = std::move(c);
    };
    auto last = [&](const std::string & base, int layer) -> Captured * {
        auto * v = occ(base, layer);
        return v && !v->empty() ? &v->back() : nullptr;
    };
    auto with_op = [&](const std::string & base, int layer, const char * op, bool want) -> Captured * {
        auto * v = occ(base, layer);
        if (!v) return nullptr;
        Captured * r = nullptr;
        for (auto & c : *v)
            if ((c.op == op) == want) r = &c;
        return r;
    };

    if (auto * c = last("embd", -1)) put("token_embd", std::move(*c), { T, n_embd });
    for (int il = 0; il < n_run; il++) {
        const std::string p = "blk." + std::to_string(il) + ".";
        // each captured node becomes one hook: moved, not copied
        auto hook = [&](const std::string & name, Captured * c, std::vector<int64_t> shape) {
            if (c) put(p + name, std::move(*c), shape);
        };
        hook("attn_norm", last("attn_norm", il), { T, n_embd });
        // q LoRA: glm-dsa names both steps "qr" and q_b "q"; deepseek2 names all three "q" (then a view)
        if (wt.arch == "glm-dsa") {
            auto * v = occ("qr", il);
            if (v && v->size() >= 2) {
                hook("q_a", &v->front(), { T, q_lora });
                hook("q_a_norm", &v->back(), { T, q_lora });
            }
            if (auto * c = with_op("q", il, "MUL_MAT", true)) hook("q_b", c, { T, 0 });
        } else {
            auto * v = occ("q", il);
            if (v) {
                std::vector<Captured *> mm, other;
                for (auto & c : *v) {
                    if (c.op == "MUL_MAT") mm.push_back(&c);
                    else if (c.op != "RESHAPE" && c.op != "VIEW") other.push_back(&c);
                }
                if (q_lora > 0 && mm.size() == 2 && !other.empty()) {
                    hook("q_a", mm[0], { T, q_lora });
                    hook("q_a_norm", other.back(), { T, q_lora });
                }
                if (!mm.empty()) hook("q_b", mm.back(), { T, 0 });
            }
        }
        hook("q_pe_rope", with_op("q_pe", il, "ROPE", true), { T, n_head, rope });
        hook("kv_a", last("kv_cmpr_pe", il), { T, 0 });
        hook("kv_a_norm", with_op("kv_cmpr", il, "VIEW", false), { T, 0 });
        hook("k_pe_rope", with_op("k_pe", il, "ROPE", true), { T, rope });
        if (auto * c = last("indexer_score", il)) {
            Captured s = std::move(*c);
            reshape(s, { T, s.shape[3] }, "indexer_scores");
            cut_columns(s, T);
            out[p + "indexer_scores"] = s;
        }
        if (auto * c = last("top_k", il)) {
            Captured s = std::move(*c);
            const int64_t k = s.shape[3];
            reshape(s, { T, k }, "indexer_topk");
            // cells are positions (a fresh cache, one sequence): a selected cell after the query's own
            // position was masked (-inf) and only fills a row shorter than top-k
            // llama.cpp's top-k returns its ids in no promised order (the CPU swaps the first two, CUB's
            // top-k is unsorted): the kept ids go first in each row, so that cutting to the hook's width
            // never drops one
            for (int64_t t = 0; t < T; t++) {
                int32_t * row = &s.i32[t * k];
                for (int64_t j = 0; j < k; j++)
                    if (row[j] > t) row[j] = -1;
                std::stable_partition(row, row + k, [](int32_t x) { return x >= 0; });
            }
            // the hook's width is min(the model's index_topk, T): a smaller top-k (an override) is padded
            int64_t width = std::min<int64_t>(wt.index_topk ? wt.index_topk : k, T);
            if (width > k) {
                std::vector<int32_t> o(T * width, -1);
                for (int64_t t = 0; t < T; t++) std::copy_n(&s.i32[t * k], k, &o[t * width]);
                s.i32.swap(o);
                s.shape = { T, width };
            } else {
                cut_columns(s, width);
            }
            out[p + "indexer_topk"] = s;
        }
        hook("attn_heads", last("kqv_out", il), { T, 0 });
        if (st.attn_out.count(il)) hook("attn_out", &st.attn_out[il], { T, n_embd });
        hook("ffn_inp", last("ffn_inp", il), { T, n_embd });
        hook("ffn_norm", last("ffn_norm", il), { T, n_embd });
        // in MoE layers these names label the shared expert's steps, which have no hook of their own
        if (il < n_dense || n_expert == 0) {
            hook("ffn_gate", last("ffn_gate", il), { T, 0 });
            hook("ffn_up", last("ffn_up", il), { T, 0 });
            hook("ffn_act", last("ffn_swiglu", il), { T, 0 });
        }
        hook("moe_logits", last("ffn_moe_logits", il), { T, 0 });
        hook("moe_probs", last("ffn_moe_probs", il), { T, 0 });
        hook("moe_topk_ids", last("ffn_moe_topk", il), { T, 0 });  // its own width (an override may change it)
        // the routing weights as used: the last of weights, normalised, scaled
        {
            Captured * w = nullptr;
            for (const char * n : { "ffn_moe_weights", "ffn_moe_weights_norm", "ffn_moe_weights_scaled" })
                if (auto * c = last(n, il)) w = c;
            hook("moe_weights", w, { T, 0 });
        }
        hook("moe_routed", last("ffn_moe_out", il), { T, n_embd });
        hook("ffn_shexp", last("ffn_shexp", il), { T, n_embd });
        hook("ffn_out", last("ffn_out", il), { T, n_embd });
        hook("l_out", last("l_out", il), { T, n_embd });
    }
    if (auto * c = last("result_norm", -1)) put("result_norm", std::move(*c), { T, n_embd });
    if (auto * c = last("result_output", -1)) put("logits", std::move(*c), { T, n_vocab });
    st.seen.clear();

    // ---- what llama.cpp did not compute as a node of its own in this run
    std::vector<std::string> per_layer = { "attn_norm", "q_b", "q_pe_rope", "kv_a", "kv_a_norm", "k_pe_rope",
                                           "attn_heads", "attn_out", "ffn_inp", "ffn_norm", "ffn_out", "l_out" };
    if (q_lora > 0) {
        per_layer.push_back("q_a");
        per_layer.push_back("q_a_norm");
    }
    if (wt.arch == "glm-dsa") {
        per_layer.push_back("indexer_scores");
        per_layer.push_back("indexer_topk");
    }
    std::map<std::string, int> missing;  // hook point → layers without it
    for (int il = 0; il < n_run; il++) {
        std::vector<std::string> want = per_layer;
        if (il < n_dense || n_expert == 0) want.insert(want.end(), { "ffn_gate", "ffn_up", "ffn_act" });
        else want.insert(want.end(), { "moe_logits", "moe_probs", "moe_topk_ids", "moe_weights", "moe_routed", "ffn_shexp" });
        for (auto & h : want)
            if (!out.count("blk." + std::to_string(il) + "." + h)) missing[h]++;
    }
    for (const char * g : { "token_embd", "result_norm", "logits" })
        if (!out.count(g)) not_captured[g] = "llama.cpp's graph had no node for it in this run";
    for (auto & [h, n] : missing)
        not_captured["blk.*." + h] = "llama.cpp's graph had no node for it in this run (" + std::to_string(n) +
                                     " layers; a fused operation or another graph version)";
    for (auto & [h, why] : not_captured) fprintf(stderr, "glmdiff-llama-dump: not captured: %s: %s\n", h.c_str(), why.c_str());

    // ---- the precision llama.cpp computed in (glmdiff docs/hooks.md, `dtype` and `precision`)
    // Activations are F32 between nodes, sums are f32. A matrix product rounds its activation operand to
    // the weight's format (below, per step); the attention and the indexer read K (and V) from a cache
    // of --kv-type, with q (and the softmax output) rounded to it.
    const ggml_type kvt = kv_type_of(a.kv_type);
    const std::string dtype = "f32 storage, f32 accumulation";

    std::string backend = "CPU";
    bool cuda = false;
    if (a.gpu_layers != 0) {
        for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
            ggml_backend_dev_t d = ggml_backend_dev_get(i);
            if (ggml_backend_dev_type(d) == GGML_BACKEND_DEVICE_TYPE_GPU) {
                backend = std::string(ggml_backend_dev_name(d)) + " " + ggml_backend_dev_description(d);
                cuda = backend.rfind("CUDA", 0) == 0;
                break;
            }
        }
    }
    // Per step: the formats its products round to, from its weights' types (and the KV cache's for
    // the attention and the indexer, whose keys are cached in it). Hooks of elementwise steps keep
    // the trace's f32 dtype.
    std::map<std::string, std::string> precision;  // hook glob → dtype text
    {
        auto ty = [&](const std::string & n, Operands & o) {
            auto it = wt.type_of.find(n);
            if (it != wt.type_of.end()) o.add(it->second);
        };
        std::map<std::string, std::map<int, std::string>> per_point;  // point → layer → dtype
        for (int il = 0; il < n_run; il++) {
            const std::string b = "blk." + std::to_string(il) + ".";
            // kv: the step reads the KV cache (attention, indexer keys): its type rounds K (and V);
            // on CUDA flash attention casts K and V to F16 and sums in f32, and without it the
            // K·q product runs in f32 (TF32) and the softmax·V product in V's type (F16: f16 sums)
            auto step = [&](const std::string & point, std::vector<std::string> weights, bool kv) {
                if (!out.count(b + point)) return;
                Operands o;
                o.cuda = cuda;
                for (auto & w : weights) ty(b + w + ".weight", o);
                const bool weights16 = o.acc16;
                if (kv && point == "attn_heads" && st.fa_seen) {
                    // flash attention casts K and V to F16; ggml-cpu's kernel sums softmax·V in f16
                    // for short batches, ggml-cuda's in f32
                    o.any = true;
                    o.rank(2);
                    if (!cuda || st.fa_on_cpu) o.acc16 = true;
                } else if (kv) {
                    o.add(kvt);
                    if (cuda && point == "indexer_scores") o.acc16 = weights16;  // the scores sum in f32
                }
                if (o.any) per_point[point][il] = o.text();
            };
            step("q_a", { "attn_q_a" }, false);
            step("q_b", { "attn_q_b", "attn_q" }, false);
            step("kv_a", { "attn_kv_a_mqa" }, false);
            step("attn_heads", { "attn_k_b", "attn_v_b" }, true);
            step("attn_out", { "attn_output" }, false);
            step("indexer_scores", { "indexer.attn_q_b", "indexer.attn_k", "indexer.proj" }, true);
            step("ffn_gate", { "ffn_gate" }, false);
            step("ffn_up", { "ffn_up" }, false);
            step("moe_logits", { "ffn_gate_inp" }, false);
            step("moe_routed", { "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps" }, false);
            step("ffn_shexp", { "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp" }, false);
            if (il < n_dense || n_expert == 0) step("ffn_out", { "ffn_down" }, false);
        }
        for (auto & [point, layers] : per_point) {
            std::set<std::string> texts;
            for (auto & [il, d] : layers) texts.insert(d);
            if (texts.size() == 1) {
                if (*texts.begin() != "f32 storage, f32 accumulation") {
                    // one glob when every layer with this point agrees (dense ffn_out: exact names,
                    // as MoE layers' ffn_out is an addition)
                    if (point == "ffn_out") {
                        for (auto & [il, d] : layers) precision["blk." + std::to_string(il) + "." + point] = d;
                    } else {
                        precision["blk.*." + point] = *texts.begin();
                    }
                }
            } else {
                for (auto & [il, d] : layers) precision["blk." + std::to_string(il) + "." + point] = d;
            }
        }
        if (out.count("logits")) {
            Operands o;
            o.cuda = cuda;
            ty("output.weight", o);
            if (o.any && o.text() != "f32 storage, f32 accumulation") precision["logits"] = o.text();
        }
    }

    if (a.gpu_layers != 0 && !cuda)
        fprintf(stderr, "glmdiff-llama-dump: --gpu-layers %d but this llama.cpp build has no CUDA device: %s\n", a.gpu_layers,
                backend == "CPU" ? "ran on the CPU" : "the precision of its backend is not modelled: written as the CPU's");

    // flash attention as llama.cpp ran it (with --flash-attn auto it decides itself)
    const std::string fa_text = std::string(st.fa_seen ? "on" : "off") + (a.flash_attn == "auto" ? " (auto)" : "") +
                                (st.fa_seen && st.fa_on_cpu && cuda ? " (on the CPU)" : "");
    std::string toks = "[";
    for (int64_t i = 0; i < T; i++) toks += (i ? "," : "") + std::to_string(a.tokens[i]);
    toks += "]";
    std::string nc = "{";
    for (auto & [h, why] : not_captured) nc += (nc.size() > 1 ? "," : "") + std::string("\"") + json_escape(h) + "\":\"" + json_escape(why) + "\"";
    nc += "}";
    std::string ovs;
    for (auto & o : a.overrides) ovs += (ovs.empty() ? "" : " ") + o;
    std::vector<std::pair<std::string, std::string>> meta = {
        { "glmdiff_trace", "1" },
        { "model", base_name(a.model) },
        { "model_digest", digest },
        { "architecture", wt.arch },
        { "tokens", toks },
        { "engine", std::string("llama.cpp ") + GLMDIFF_LLAMA_COMMIT + " " + backend + ", KV cache " + a.kv_type +
                        ", flash attention " + fa_text + (ovs.empty() ? "" : ", overrides " + ovs) },
        { "dtype", dtype },
        { "mode", "chained" },
        { "hook_script", TOOL_VERSION },
        { "llama_cpp_commit", GLMDIFF_LLAMA_COMMIT },
        { "llama_cpp_backend", backend },
        { "llama_cpp_kv_cache_type", a.kv_type },
        { "llama_cpp_flash_attn", fa_text },
    };
    if (!precision.empty()) {
        std::string pm = "{";
        for (auto & [g, d] : precision) pm += (pm.size() > 1 ? "," : "") + std::string("\"") + json_escape(g) + "\":\"" + json_escape(d) + "\"";
        pm += "}";
        meta.push_back({ "precision", pm });
    }
    if (!ovs.empty()) meta.push_back({ "llama_cpp_overrides", ovs });
    if (!a.prompt.empty()) meta.push_back({ "prompt", a.prompt });
    if (!not_captured.empty()) meta.push_back({ "not_captured", nc });
    write_safetensors(a.out, out, meta);
    fprintf(stderr, "glmdiff-llama-dump: wrote %zu hooks of %" PRId64 " tokens to %s (%s; %s)\n", out.size(), T, a.out.c_str(), backend.c_str(), dtype.c_str());

    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
