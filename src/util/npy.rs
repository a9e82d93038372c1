//! The `.npy` format (NumPy format version 1.0): a magic string, a header dict padded to a
//! multiple of 64 bytes, then the raw little-endian data in C order.
//! Reference: numpy `numpy/lib/format.py`.

use std::io::Write;

use anyhow::Result;

/// Element types glmdiff writes.
#[derive(Clone, Copy, Debug)]
pub enum NpyDtype {
    /// little-endian f32 (`<f4`)
    F32,
    /// little-endian i32 (`<i4`)
    I32,
}

/// Writes the `.npy` header for an array of `shape` (C order).
pub fn write_header(w: &mut dyn Write, dtype: NpyDtype, shape: &[u64]) -> Result<()> {
    let descr = match dtype {
        NpyDtype::F32 => "<f4",
        NpyDtype::I32 => "<i4",
    };
    let shape_str = match shape.len() {
        0 => "()".to_string(),
        1 => format!("({},)", shape[0]),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_str}, }}");
    // magic(6) + version(2) + header_len(2) + header + '\n' must be a multiple of 64.
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    w.write_all(b"\x93NUMPY\x01\x00")?;
    w.write_all(&(header.len() as u16).to_le_bytes())?;
    w.write_all(header.as_bytes())?;
    Ok(())
}

/// Writes a whole f32 array as `.npy`.
pub fn write_f32(w: &mut dyn Write, shape: &[u64], data: &[f32]) -> Result<()> {
    write_header(w, NpyDtype::F32, shape)?;
    for chunk in data.chunks(1 << 16) {
        let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.write_all(&bytes)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_64_aligned_and_readable() {
        let mut v = Vec::new();
        write_f32(&mut v, &[2, 3], &[0.0; 6]).unwrap();
        assert_eq!(&v[..8], b"\x93NUMPY\x01\x00");
        let hl = u16::from_le_bytes([v[8], v[9]]) as usize;
        assert_eq!((10 + hl) % 64, 0);
        let h = std::str::from_utf8(&v[10..10 + hl]).unwrap();
        assert!(h.contains("'shape': (2, 3)"), "{h}");
        assert_eq!(v.len(), 10 + hl + 24);
    }
}
