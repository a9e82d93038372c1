//! Byte-level BPE: the GPT-2 byte-to-character map and the merge loop.
//!
//! The byte map is GPT-2's `bytes_to_unicode` (openai/gpt-2 `src/encoder.py`; the same table as
//! llama.cpp `src/unicode.cpp` `unicode_byte_to_utf8_map` and Hugging Face tokenizers
//! `pre_tokenizers/byte_level.rs`): printable Latin-1 bytes map to themselves, the other 68
//! bytes to U+0100.. in byte order. Merging repeatedly joins the adjacent pair of lowest merge
//! rank, the leftmost on ties (llama.cpp `llm_tokenizer_bpe_session::tokenize`, Hugging Face
//! `models/bpe/word.rs` `merge_all`, which agree).

use std::collections::HashMap;

/// Characters standing for each byte in GPT-2 byte-level token text (index = byte).
pub fn byte_to_char() -> [char; 256] {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut out = ['\0'; 256];
    let mut next = 0x100u32;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            let c = next;
            next += 1;
            c
        };
        // Cannot fail: every value is below 0x100 + 68, inside the Basic Multilingual Plane
        // and outside the surrogate range.
        out[b as usize] = char::from_u32(c).unwrap_or('\0');
    }
    out
}

/// The inverse of [`byte_to_char`].
pub fn char_to_byte() -> HashMap<char, u8> {
    byte_to_char()
        .iter()
        .enumerate()
        .map(|(b, &c)| (c, b as u8))
        .collect()
}

/// Merge table: (left id, right id) -> (rank, merged id).
pub type Merges = HashMap<(u32, u32), (u32, u32)>;

/// Applies `merges` to `symbols` (token ids of single byte characters), in place.
pub fn merge(symbols: &mut Vec<u32>, merges: &Merges) {
    // Pieces are short (a word); a quadratic scan is simpler than a heap and fast enough.
    while symbols.len() > 1 {
        let mut best: Option<(u32, usize, u32)> = None; // (rank, position, merged id)
        for i in 0..symbols.len() - 1 {
            if let Some(&(rank, id)) = merges.get(&(symbols[i], symbols[i + 1])) {
                if best.is_none_or(|(r, _, _)| rank < r) {
                    best = Some((rank, i, id));
                }
            }
        }
        let Some((_, i, id)) = best else { break };
        symbols[i] = id;
        symbols.remove(i + 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_matches_gpt2() {
        let m = byte_to_char();
        // Values from GPT-2's bytes_to_unicode: space -> 'Ġ' (U+0120), newline -> 'Ċ' (U+010A),
        // 'A' -> 'A', 0xAD -> U+0143 ('Ń'), 0xFF -> 'ÿ', 0x00 -> 'Ā' (U+0100).
        assert_eq!(m[b' ' as usize], 'Ġ');
        assert_eq!(m[b'\n' as usize], 'Ċ');
        assert_eq!(m[b'A' as usize], 'A');
        assert_eq!(m[0xAD], 'Ń');
        assert_eq!(m[0xFF], 'ÿ');
        assert_eq!(m[0], 'Ā');
        assert_eq!(char_to_byte().len(), 256);
    }

    #[test]
    fn lowest_rank_merges_first_and_ties_go_left() {
        // a=0 b=1 ab=2 bb=3 abb=4; merges: "b b" rank 0, "a b" rank 1, "ab b" rank 2.
        let merges: Merges = [((1, 1), (0, 3)), ((0, 1), (1, 2)), ((2, 1), (2, 4))]
            .into_iter()
            .collect();
        let mut s = vec![0, 1, 1];
        merge(&mut s, &merges);
        assert_eq!(s, [0, 3]); // "b b" wins over "a b", then "a bb" has no merge
        let mut s = vec![1, 1, 1];
        merge(&mut s, &merges);
        assert_eq!(s, [3, 1]); // leftmost of two equal-rank pairs
    }
}
