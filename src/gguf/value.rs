//! GGUF metadata values.

use std::fmt;

/// The value type ids of GGUF metadata (`enum gguf_type` in ggml's `gguf.h`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
#[allow(missing_docs)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The type with id `id`, or `None` when the id is not a GGUF value type.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Bytes of one value of this type in the file, `None` for strings and arrays (variable).
    pub fn fixed_size(self) -> Option<usize> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// Lowest number of bytes one element of this type can take in the file (strings: the
    /// u64 length; arrays: u32 type + u64 count). Used to bound element counts.
    pub fn min_size(self) -> usize {
        match self {
            ValueType::String => 8,
            ValueType::Array => 12,
            t => t.fixed_size().unwrap_or(1),
        }
    }

    /// Lowercase name, as gguf-py prints it.
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
#[allow(missing_docs)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// Element type and elements (all of that type; nested arrays are `Array` elements).
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The value's type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Any integer value (and bool) as i128, so that every integer type converts losslessly.
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            Value::Bool(v) => v.into(),
            _ => return None,
        })
    }

    /// Any numeric value as f64 (integers converted, floats widened).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_int().map(|v| v as f64),
        }
    }

    /// The string, if this is a string value.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements, if this is an array value.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(_, v) => Some(v),
            _ => None,
        }
    }

    /// A short human-readable rendering: long arrays show their length and first elements.
    pub fn summary(&self, max_items: usize) -> String {
        match self {
            Value::Array(t, v) => {
                let shown: Vec<String> = v.iter().take(max_items).map(|x| x.summary(3)).collect();
                let more = if v.len() > max_items { ", ..." } else { "" };
                format!("[{}; {}] [{}{}]", t.name(), v.len(), shown.join(", "), more)
            }
            Value::String(s) => {
                let mut t: String = s.chars().take(80).collect();
                if t.len() < s.len() {
                    t.push_str("...");
                }
                format!("{t:?}")
            }
            other => other.to_string(),
        }
    }

    /// The value as JSON (arrays of any depth, strings, numbers; non-finite floats as strings).
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Value::String(s) => J::String(s.clone()),
            Value::Bool(b) => J::Bool(*b),
            Value::Array(_, v) => J::Array(v.iter().map(Value::to_json).collect()),
            Value::F32(_) | Value::F64(_) => {
                let f = self.as_f64().unwrap_or(f64::NAN);
                serde_json::Number::from_f64(f)
                    .map(J::Number)
                    .unwrap_or_else(|| J::String(f.to_string()))
            }
            Value::U64(v) => J::from(*v),
            Value::I64(v) => J::from(*v),
            other => J::from(other.as_int().unwrap_or_default() as i64),
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::U8(v) => write!(f, "{v}"),
            Value::I8(v) => write!(f, "{v}"),
            Value::U16(v) => write!(f, "{v}"),
            Value::I16(v) => write!(f, "{v}"),
            Value::U32(v) => write!(f, "{v}"),
            Value::I32(v) => write!(f, "{v}"),
            Value::F32(v) => {
                let plain = (PLAIN_FLOAT_MIN as f32..PLAIN_FLOAT_MAX as f32).contains(&v.abs());
                write_float(f, *v == 0.0 || !v.is_finite() || plain, v)
            }
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(s) => write!(f, "{s}"),
            Value::Array(..) => write!(f, "{}", self.summary(8)),
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => {
                let plain = (PLAIN_FLOAT_MIN..PLAIN_FLOAT_MAX).contains(&v.abs());
                write_float(f, *v == 0.0 || !v.is_finite() || plain, v)
            }
        }
    }
}

/// Smallest magnitude printed positionally; below it a float is printed as `1e-300`, not as
/// hundreds of digits.
const PLAIN_FLOAT_MIN: f64 = 1e-5;
/// Magnitude from which a float is printed in exponent form.
const PLAIN_FLOAT_MAX: f64 = 1e16;

/// Writes `v` positionally (`Display`) when `plain`, else in exponent form (`LowerExp`).
fn write_float<T: fmt::Display + fmt::LowerExp>(
    f: &mut fmt::Formatter<'_>,
    plain: bool,
    v: &T,
) -> fmt::Result {
    if plain {
        write!(f, "{v}")
    } else {
        write!(f, "{v:e}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: `inspect` printed an f64 of 1e-300 as a 300-digit decimal.
    #[test]
    fn extreme_floats_display_in_exponent_form() {
        assert_eq!(Value::F64(1e-300).to_string(), "1e-300");
        assert_eq!(Value::F64(-1e300).to_string(), "-1e300");
        assert_eq!(Value::F32(3.25e-6).to_string(), "3.25e-6");
        assert_eq!(Value::F32(1e-5).to_string(), "0.00001");
        assert_eq!(Value::F32(1_000_000.0).to_string(), "1000000");
        assert_eq!(Value::F64(-2.5).to_string(), "-2.5");
        assert_eq!(Value::F32(-0.0).to_string(), "-0");
        assert_eq!(Value::F64(f64::INFINITY).to_string(), "inf");
    }

    /// `MAX_ARRAY_ELEMENTS` bounds the metadata's memory by this size.
    #[test]
    fn a_value_takes_32_bytes() {
        assert_eq!(std::mem::size_of::<Value>(), 32);
    }
}
