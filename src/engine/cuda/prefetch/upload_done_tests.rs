//! [`Prefetch::upload_done`] without an uploader: nothing is waited for, and the prefetch stays
//! usable.

use super::*;

#[test]
fn without_an_uploader_nothing_is_waited_for() {
    let mut p = Prefetch::new(true);
    for (id, (name, state)) in [
        ("blk.1.a", State::Issued),
        ("blk.1.b", State::Arrived(Outcome::Failed("test".into()))),
    ]
    .into_iter()
    .enumerate()
    {
        let (id, layer) = (id as u64, 1);
        p.pending
            .insert(name.to_string(), Entry { id, layer, state });
    }
    assert_eq!(p.upload_done("blk.1.a"), None);
    assert_eq!(p.upload_done("blk.1.b"), None);
    assert_eq!(p.upload_done("blk.1.c"), None);
    assert!(!p.dead);
}
