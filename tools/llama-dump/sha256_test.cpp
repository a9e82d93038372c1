// Checks sha256.h against FIPS 180-4's known answers (and padding boundaries, and chunked input
// against one-shot input). build.sh compiles and runs it after building; exit 1 on any mismatch.
//
//   g++ -std=c++17 -O2 tools/llama-dump/sha256_test.cpp -o sha256_test && ./sha256_test

#include "sha256.h"

#include <algorithm>
#include <cstdio>
#include <string>

static int failures = 0;

static void check(const char * what, const std::string & got, const char * want) {
    const bool ok = got == want;
    if (!ok) failures++;
    printf("%s %s: %s%s%s\n", ok ? "ok  " : "FAIL", what, got.c_str(), ok ? "" : " expected ", ok ? "" : want);
}

int main() {
    check("\"\"", Sha256::hex_of("", 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    check("\"abc\"", Sha256::hex_of("abc", 3), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    const std::string m448 = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    check("448-bit message", Sha256::hex_of(m448.data(), m448.size()),
          "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    const std::string m896 = "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu";
    check("896-bit message", Sha256::hex_of(m896.data(), m896.size()),
          "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
    const char * million = "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0";
    const std::string a(1000000, 'a');
    check("one million 'a'", Sha256::hex_of(a.data(), a.size()), million);
    // the same fed in pieces of 1 to 130 bytes: the block buffer's every fill level
    {
        Sha256 h;
        size_t off = 0;
        for (size_t k = 1; off < a.size(); k = k % 130 + 1) {
            const size_t n = std::min(k, a.size() - off);
            h.update(a.data() + off, n);
            off += n;
        }
        check("one million 'a' in pieces", h.hex(), million);
    }
    // lengths around the padding's boundaries (the length field fits in the last block or not)
    const struct {
        size_t n;
        const char * want;
    } pads[] = {
        { 55, "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318" },
        { 56, "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a" },
        { 57, "f13b2d724659eb3bf47f2dd6af1accc87b81f09f59f2b75e5c0bed6589dfe8c6" },
        { 63, "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34" },
        { 64, "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb" },
        { 65, "635361c48bb9eab14198e76ea8ab7f1a41685d6ad62aa9146d301d4f17eb0ae0" },
        { 119, "31eba51c313a5c08226adf18d4a359cfdfd8d2e816b13f4af952f7ea6584dcfb" },
        { 120, "2f3d335432c70b580af0e8e1b3674a7c020d683aa5f73aaaedfdc55af904c21c" },
        { 128, "6836cf13bac400e9105071cd6af47084dfacad4e5e302c94bfed24e013afb73e" },
    };
    for (const auto & p : pads) {
        const std::string what = std::to_string(p.n) + " x 'a'";
        check(what.c_str(), Sha256::hex_of(a.data(), p.n), p.want);
    }
    // little-endian integer helpers: u32 1 then u64 2 are the bytes 01 00 00 00 02 00 .. 00
    {
        Sha256 h;
        h.update_u32le(1);
        h.update_u64le(2);
        const unsigned char le[12] = { 1, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0 };
        const std::string want = Sha256::hex_of(le, sizeof le);
        check("u32le(1) u64le(2)", h.hex(), want.c_str());
    }
    if (failures) {
        printf("sha256 self-test: %d FAILED\n", failures);
        return 1;
    }
    printf("sha256 self-test: all passed\n");
    return 0;
}
