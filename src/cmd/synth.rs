//! `glmdiff synth`: flags to [`crate::synth::SynthOptions`], write the file, print a summary.

use std::time::Instant;

use anyhow::Result;

use super::Outcome;
use crate::cli::SynthArgs;
use crate::synth::{self, SynthOptions};

/// Bytes in a GiB, for the summary line.
const GIB: f64 = (1u64 << 30) as f64;

/// Runs `glmdiff synth`.
pub fn run(args: &SynthArgs) -> Result<Outcome> {
    let opts = SynthOptions::parse(&args.arch, &args.dims, args.layers, &args.types, args.seed)?;
    crate::util::guard::Guard::new()
        .output("--out", Some(&args.out))
        .check()?;
    let t0 = Instant::now();
    let s = synth::write_with_progress(&opts, &args.out, &crate::report::progress::Bar::bytes())?;
    let secs = t0.elapsed().as_secs_f64();
    let mut text = format!(
        "wrote {}: {} ({} dims), {} blocks, {} tensors, {} bytes ({:.2} GiB) in {secs:.1} s ({:.0} MiB/s)\n",
        args.out.display(),
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
    crate::report::emit(&text);
    Ok(Outcome::Ok)
}
