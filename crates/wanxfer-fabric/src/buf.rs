//! Page-aligned heap buffers.
//!
//! Why: RDMA NICs register whole pages, some providers (FI_MR_ALLOCATED)
//! insist registered memory be backed by real allocations, and block pools
//! want slot boundaries on page boundaries so direct I/O can read straight
//! into a slot. `Vec<u8>` gives none of these guarantees.

use std::alloc::{self, Layout};
use std::ptr::NonNull;

/// Alignment of every [`AlignedBuf`].
pub const PAGE: usize = 4096;

/// A zero-initialised, page-aligned byte buffer whose address never moves.
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like Box<[u8]>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared references only hand out shared slices.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes (at least one page is reserved for
    /// `len == 0` so the pointer is always real).
    pub fn new(len: usize) -> Self {
        let size = len.max(1).next_multiple_of(PAGE);
        let layout = Layout::from_size_align(size, PAGE).expect("page-rounded size fits isize");
        // SAFETY: the layout has non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, layout }
    }

    /// Usable length (the requested length rounded up to whole pages).
    pub fn len(&self) -> usize {
        self.layout.size()
    }

    /// Never true: the buffer holds at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len()) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len()) }
    }

    /// Start of the buffer.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// Memory that can be handed to [`crate::Connection::register`], which keeps
/// it alive (and in place) until the registration and every operation using
/// it are gone.
///
/// # Safety
/// `region` must return the same pointer and length every time, valid for
/// reads and writes for as long as the value lives, even after the value is
/// moved (i.e. the bytes live on the heap, not inline).
pub unsafe trait RegisterMem: Send + Sync + 'static {
    /// Start and length of the memory.
    fn region(&mut self) -> (*mut u8, usize);
}

// SAFETY: the heap allocation of a Vec does not move when the Vec moves, and
// the Vec is never resized while registered (we own it and do not touch it).
unsafe impl RegisterMem for Vec<u8> {
    fn region(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

// SAFETY: a boxed slice's bytes live on the heap and never move.
unsafe impl RegisterMem for Box<[u8]> {
    fn region(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}

// SAFETY: AlignedBuf's allocation never moves.
unsafe impl RegisterMem for AlignedBuf {
    fn region(&mut self) -> (*mut u8, usize) {
        (self.as_mut_ptr(), self.len())
    }
}
