//! Words of shell commands that glmdiff prints for the user to run again.

/// Quotes a word for a POSIX shell when it needs it.
pub fn shell_word(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@+".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_quoted_only_when_a_shell_would_split_or_expand_them() {
        assert_eq!(shell_word("blk.0.attn_out"), "blk.0.attn_out");
        assert_eq!(
            shell_word("trace:a/b-c.safetensors"),
            "trace:a/b-c.safetensors"
        );
        assert_eq!(shell_word(""), "''");
        assert_eq!(shell_word("blk.*.q_a"), "'blk.*.q_a'");
        assert_eq!(shell_word("my model.gguf"), "'my model.gguf'");
        assert_eq!(shell_word("it's"), "'it'\\''s'");
    }
}
