//! 64-bit FNV-1a (Fowler, Noll, Vo): the stable hash behind the reference cache's file names and
//! checksums and the compiled-kernel cache's keys.

/// 64-bit FNV-1a (Fowler, Noll, Vo): a stable hash for file names and cheap identity checks.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_matches_published_vectors() {
        // Test vectors of the FNV reference (isthe.com/chongo/tech/comp/fnv): "" and "a".
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }
}
