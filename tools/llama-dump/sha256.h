// SHA-256 (FIPS 180-4), streaming: Sha256 h; h.update(p, n)...; h.hex() (or h.digest()).
// Written for glmdiff-llama-dump's `model_digest`; checked against FIPS 180-4's known answers by
// sha256_test.cpp, which build.sh compiles and runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

class Sha256 {
  public:
    Sha256() { reset(); }

    void reset() {
        static const uint32_t init[8] = { 0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                          0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19 };
        memcpy(state_, init, sizeof state_);
        buf_len_ = 0;
        total_ = 0;
        done_ = false;
    }

    void update(const void * data, size_t n) {
        const uint8_t * p = static_cast<const uint8_t *>(data);
        total_ += n;
        if (buf_len_ > 0) {
            size_t take = n < 64 - buf_len_ ? n : 64 - buf_len_;
            memcpy(buf_ + buf_len_, p, take);
            buf_len_ += take;
            p += take;
            n -= take;
            if (buf_len_ < 64) return;
            block(buf_);
            buf_len_ = 0;
        }
        for (; n >= 64; p += 64, n -= 64) block(p);
        memcpy(buf_, p, n);
        buf_len_ = n;
    }

    void update(const std::string & s) { update(s.data(), s.size()); }

    // Little-endian integers, as the model digest lays them out.
    void update_u32le(uint32_t v) {
        uint8_t b[4];
        for (int i = 0; i < 4; i++) b[i] = (uint8_t) (v >> (8 * i));
        update(b, 4);
    }
    void update_u64le(uint64_t v) {
        uint8_t b[8];
        for (int i = 0; i < 8; i++) b[i] = (uint8_t) (v >> (8 * i));
        update(b, 8);
    }

    // The 32-byte digest; the hasher is finished afterwards (reset() to reuse it).
    void digest(uint8_t out[32]) {
        if (!done_) {
            const uint64_t bits = total_ * 8;
            const uint8_t pad = 0x80;
            update(&pad, 1);
            const uint8_t zero[64] = { 0 };
            // pad with zeros until 56 bytes of the last block are used, then the length in bits (big-endian)
            update(zero, (buf_len_ <= 56 ? 56 : 120) - buf_len_);
            uint8_t len[8];
            for (int i = 0; i < 8; i++) len[i] = (uint8_t) (bits >> (56 - 8 * i));
            update(len, 8);
            done_ = true;
        }
        for (int i = 0; i < 8; i++) {
            out[4 * i + 0] = (uint8_t) (state_[i] >> 24);
            out[4 * i + 1] = (uint8_t) (state_[i] >> 16);
            out[4 * i + 2] = (uint8_t) (state_[i] >> 8);
            out[4 * i + 3] = (uint8_t) state_[i];
        }
    }

    // The digest as 64 lowercase hex digits.
    std::string hex() {
        uint8_t d[32];
        digest(d);
        static const char * digits = "0123456789abcdef";
        std::string s(64, '0');
        for (int i = 0; i < 32; i++) {
            s[2 * i] = digits[d[i] >> 4];
            s[2 * i + 1] = digits[d[i] & 15];
        }
        return s;
    }

    static std::string hex_of(const void * data, size_t n) {
        Sha256 h;
        h.update(data, n);
        return h.hex();
    }

  private:
    uint32_t state_[8];
    uint8_t buf_[64];
    size_t buf_len_;
    uint64_t total_;
    bool done_;

    static uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

    // One 512-bit block (FIPS 180-4, 6.2.2).
    void block(const uint8_t * p) {
        static const uint32_t K[64] = {
            0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
            0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
            0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
            0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
            0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
            0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
            0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
            0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
        };
        uint32_t w[64];
        for (int t = 0; t < 16; t++)
            w[t] = (uint32_t) p[4 * t] << 24 | (uint32_t) p[4 * t + 1] << 16 | (uint32_t) p[4 * t + 2] << 8 |
                   (uint32_t) p[4 * t + 3];
        for (int t = 16; t < 64; t++) {
            const uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
            const uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
        uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
        for (int t = 0; t < 64; t++) {
            const uint32_t S1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
            const uint32_t ch = (e & f) ^ (~e & g);
            const uint32_t t1 = h + S1 + ch + K[t] + w[t];
            const uint32_t S0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
            const uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
            const uint32_t t2 = S0 + maj;
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        state_[0] += a;
        state_[1] += b;
        state_[2] += c;
        state_[3] += d;
        state_[4] += e;
        state_[5] += f;
        state_[6] += g;
        state_[7] += h;
    }
};
