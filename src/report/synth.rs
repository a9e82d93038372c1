//! Printing `glmdiff synth`: what was written, in how long, and the bytes of each type.

use std::path::Path;

use crate::synth::{SynthOptions, SynthSummary};

/// Bytes in a GiB.
const GIB: f64 = (1u64 << 30) as f64;

/// The summary of the file `out` written for `opts`.
pub fn render(out: &Path, opts: &SynthOptions, s: &SynthSummary) -> String {
    let secs = s.seconds;
    let mut text = format!(
        "wrote {}: {} ({} dims), {} blocks, {} tensors, {} bytes ({:.2} GiB) in {secs:.1} s ({:.0} MiB/s)\n",
        out.display(),
        opts.arch.as_str(),
        opts.dims.name,
        s.block_count,
        s.n_tensors,
        s.file_bytes,
        s.file_bytes as f64 / GIB,
        s.file_bytes as f64 / (1u64 << 20) as f64 / secs.max(1e-9)
    );
    for (ty, (n, bytes)) in &s.types {
        text.push_str(&format!(
            "  {:<8} {n:>5} tensors {:>10.3} GiB\n",
            ty.name(),
            *bytes as f64 / GIB
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;

    /// 2 GiB in 2 s is 1024 MiB/s; each type's bytes are shown in GiB.
    #[test]
    fn the_summary_says_size_time_and_rate() {
        let opts = SynthOptions::parse("glm-dsa", "tiny", None, "q8_0", 0).unwrap();
        let s = SynthSummary {
            n_tensors: 3,
            block_count: 2,
            file_bytes: 2 << 30,
            types: [(GgmlType::Q8_0, (3, 1 << 30))].into_iter().collect(),
            seconds: 2.0,
        };
        let text = render(Path::new("m.gguf"), &opts, &s);
        assert!(
            text.starts_with(
                "wrote m.gguf: glm-dsa (tiny dims), 2 blocks, 3 tensors, 2147483648 bytes (2.00 GiB) in 2.0 s (1024 MiB/s)\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("  Q8_0         3 tensors      1.000 GiB\n"),
            "{text}"
        );
    }
}
