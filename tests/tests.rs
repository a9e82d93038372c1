
mod common;
mod malformed;
